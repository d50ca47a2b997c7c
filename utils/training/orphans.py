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


class LauncherWatch:
    """The launcher this worker started under; says once, from whichever path sees it first, that it is gone."""

    def __init__(self, parent: int) -> None:
        self.parent = parent
        self._told = threading.Lock()  # held by the first to report: the watcher thread or report_if_gone

    def gone(self) -> bool:
        return os.getppid() != self.parent

    def report_if_gone(self, signum: int = signal.SIGTERM) -> None:
        """Log that the launcher is gone, if it is and nobody said so yet. The kernel's parent-death signal arrives
        with no message, and a worker that saves and exits within the watcher's poll interval would otherwise stop
        without saying why; the trainer calls this after a stop by a signal."""
        if self.gone() and self._told.acquire(blocking=False):
            logger.warning(
                "The launcher (PID %d) is gone; stopping this worker as for %s",
                self.parent,
                signal.Signals(signum).name,
            )


def stop_when_orphaned(signum: int = signal.SIGTERM, poll_interval_s: float = POLL_INTERVAL_S) -> LauncherWatch:
    """Send ``signum`` to this process as soon as its parent (the launcher) is gone."""
    watch = LauncherWatch(os.getppid())
    if sys.platform.startswith("linux"):
        _request_parent_death_signal(signum)
    # The parent may have died before the request: then nobody will send the signal.
    if watch.gone():
        _stop(watch, signum)
        return watch
    watcher = threading.Thread(
        target=_watch_parent, args=(watch, signum, poll_interval_s), name="orphan-watch", daemon=True
    )
    watcher.start()
    return watch


def _request_parent_death_signal(signum: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
            logger.debug("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as error:  # no libc symbol: the parent-PID check still works
        logger.debug("prctl unavailable: %s", error)


def _watch_parent(watch: LauncherWatch, signum: int, poll_interval_s: float) -> None:
    stopped = threading.Event()
    while not stopped.wait(poll_interval_s):
        if watch.gone():
            _stop(watch, signum)
            return


def _stop(watch: LauncherWatch, signum: int) -> None:
    watch.report_if_gone(signum)
    os.kill(os.getpid(), signum)
