"""No orphaned writers: a worker whose launcher died stops as if it had been sent SIGTERM.

torchrun's agent is the parent of its workers. When it is killed with SIGKILL it cannot stop them, and they would
train to the end and keep writing checkpoints for a job nobody supervises. So a supervised worker asks the kernel for
SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``, Linux) and, on every platform, a daemon thread compares
the parent PID every second. Either way the signal goes through ``utils.training.interrupts``: every rank stops at
the same step, global rank 0 writes ``INTERRUPTED.pth``, and the process exits with 143.

Only under a launcher: a ``python train.py`` whose shell exits (``nohup``) is meant to keep running.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
POLL_INTERVAL_S = 1.0


def stop_when_orphaned(signum: int = signal.SIGTERM, poll_interval_s: float = POLL_INTERVAL_S) -> None:
    """Send ``signum`` to this process as soon as its parent (the launcher) is gone."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        _request_parent_death_signal(signum)
    # The parent may have died before the request: then nobody will send the signal.
    if os.getppid() != parent:
        _stop(parent, signum)
        return
    watcher = threading.Thread(
        target=_watch_parent, args=(parent, signum, poll_interval_s), name="orphan-watch", daemon=True
    )
    watcher.start()


def _request_parent_death_signal(signum: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
            logger.debug("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as error:  # no libc symbol: the parent-PID check still works
        logger.debug("prctl unavailable: %s", error)


def _watch_parent(parent: int, signum: int, poll_interval_s: float) -> None:
    stopped = threading.Event()
    while not stopped.wait(poll_interval_s):
        if os.getppid() != parent:
            _stop(parent, signum)
            return


def _stop(parent: int, signum: int) -> None:
    logger.warning("The launcher (PID %d) is gone; stopping this worker as for %s", parent, signal.Signals(signum).name)
    os.kill(os.getpid(), signum)
