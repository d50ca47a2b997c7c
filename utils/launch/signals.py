"""Signals, in one place: Ctrl-C during start-up, the graceful stop on SIGINT/SIGTERM, SLURM's requeue signal and the
orphaned worker. Standard library only: the entry scripts import this before torch.

* Start-up: until the script installs its own handling (``InterruptFlag`` in train.py; predict.py and evaluate.py
  call ``startup_done`` so that Ctrl-C raises KeyboardInterrupt again, which ``process_group.run_main`` reports), a
  SIGINT would interrupt an import and print a long traceback through torch's modules: one line and exit 130 instead.
  train.py catches SIGTERM and the requeue signals from its first line too (``catch_signals_from_start``): SLURM's
  ``--signal`` can land while torch is imported, whose default action would end the job FAILED with nothing saved.
  Such a signal is remembered and the first ``InterruptFlag.install`` takes it (the run stops at its first step
  boundary: saved, requeued). Once training is over they are ignored (``InterruptFlag.restore``): the work is done,
  and a requeue would train nothing, so the job ends with the run's own status (COMPLETED 0:0 after "Training
  complete"), and soon: train.py skips Python's finalisation (``utils.launch.process_group.leave``).
* Graceful stop: the handler only records the signal (saving inside a handler can hang, Lightning #21406); the ranks
  agree on the step to stop at (``utils.launch.process_group.StopAgreement``), rank 0 writes ``INTERRUPTED.pth`` and
  every process exits with ``128 + signal`` (130 for SIGINT, 143 for SIGTERM).
* Requeue at the time limit: ``#SBATCH --signal=USR1@120`` makes SLURM send SIGUSR1 to every task 120 s before the
  limit. It is handled as SIGTERM is (``--requeue-signal``); once every rank has left the loop, rank 0 alone runs
  ``scontrol requeue $SLURM_JOB_ID`` once, SLURM ends the job's tasks and queues the same script again, and its
  ``--resume auto`` continues the run. A missing or failing ``scontrol`` is one warning: the checkpoint is there and
  a manual resubmission continues it. SLURM's own ``--requeue`` covers pre-emption and node failure, not the time
  limit. docs/CLUSTERS.md.
* Orphans: torchrun's agent is the parent of its workers; killed with SIGKILL it cannot stop them, and they would
  train to the end and keep writing checkpoints for a job nobody supervises. So in a supervised worker a daemon
  thread compares the parent PID every second and, once the parent is gone, says so and sends the worker SIGTERM: it
  stops as for SIGTERM above (exit 143). Only under a launcher: a ``python train.py`` whose shell exits (``nohup``)
  is meant to keep running.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from types import FrameType
from typing import Any

from utils.launch.environments import LaunchPlan

logger = logging.getLogger(__name__)

REMEMBERED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
"""Caught by ``catch_signals_from_start`` before the requeue signal is known (``--requeue-signal``: USR1 or USR2)."""
SCONTROL_TIMEOUT_S = 60.0
POLL_INTERVAL_S = 1.0


def signal_exit_code(signum: int) -> int:
    """Shell convention for death by a signal: 128 + signal (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + signum


def _remember(signum: int, frame: FrameType | None) -> None:
    if signum == signal.SIGINT:
        # Nothing has been created yet: leave at once (os._exit: no half-imported module's clean-up runs).
        sys.stderr.write("Error: stopped by SIGINT (Ctrl-C) while starting; nothing was written\n")
        sys.stderr.flush()
        os._exit(signal_exit_code(signal.SIGINT))
    _STARTUP._handle(signum, frame)


def catch_signals_from_start(remembered: tuple[int, ...] = REMEMBERED_SIGNALS) -> None:
    """An entry script's first call: SIGINT exits with one line and status 130 until the script installs its own
    handling; the ``remembered`` signals (train.py's: SIGTERM/SIGUSR1/SIGUSR2) are kept for the run's
    ``InterruptFlag``, and all of them ignored once the training is over. Handlers a parent chose are left alone."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _remember)
    for signum in remembered:
        if signal.getsignal(signum) == signal.SIG_DFL:
            signal.signal(signum, _remember)


def stop_quietly_while_starting() -> None:
    """predict.py's and evaluate.py's first call: ``catch_signals_from_start`` for SIGINT alone."""
    catch_signals_from_start(remembered=())


def stopped_during_startup() -> bool:
    """Whether SIGTERM reached ``catch_signals_from_start``'s handler and no ``InterruptFlag`` took it yet."""
    return _STARTUP.signum == signal.SIGTERM


def startup_done() -> None:
    """Give SIGINT back to Python (KeyboardInterrupt) once the imports are over: from then on the script may have
    written something, and its own handling says what. Leaves any other handler alone (a test, a parent's choice)."""
    if signal.getsignal(signal.SIGINT) is _remember:
        signal.signal(signal.SIGINT, signal.default_int_handler)


class InterruptFlag:
    """Records the first handled signal received while installed; later ones are ignored (the first one wins)."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}

    def install(self, requeue_signal: int | None = None) -> InterruptFlag:
        """Handle SIGINT, SIGTERM and, under SLURM, the requeue signal (``LaunchPlan.requeue_signal``); one of them
        that arrived during start-up (``catch_signals_from_start``) counts as received now."""
        handled = [signum for signum in (signal.SIGINT, signal.SIGTERM, requeue_signal) if signum is not None]
        for signum in handled:
            self._previous[signum] = signal.signal(signum, self._handle)
        if _STARTUP.signum in handled:
            self._handle(_STARTUP.signum, None)
        _STARTUP.signum = 0
        return self

    def restore(self) -> None:
        """Give the handlers back; train.py's start-up ones become SIG_IGN: the run is over, and Python's own exit
        resets every handler it installed to SIG_DFL (a signal during its seconds-long finalisation would kill the
        process), but leaves ignored signals ignored."""
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_IGN if handler is _remember else handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Nothing else here: the main thread may be inside a collective, a checkpoint write or the logging lock.
        if not self.signum:
            self.signum = signum


_STARTUP = InterruptFlag()
"""The first signal ``catch_signals_from_start``'s handler saw, until ``InterruptFlag.install`` takes it."""


def requeue_if_asked(plan: LaunchPlan, stopped_by: int) -> bool:
    """On global rank 0, once the run stopped for the requeue signal: run ``scontrol requeue JOB`` once; whether the
    job was requeued (False, after one warning, when scontrol is missing or fails).

    Called after ``Trainer.train`` returned, whose final barrier means every rank has left the loop and rank 0 has
    written its files. Also when the stop could not save (a skipped step): the newest checkpoint is then older, and
    the requeued job still continues from it.
    """
    if plan.rank != 0 or plan.slurm_job_id is None or stopped_by != plan.requeue_signal:
        return False
    command = ["scontrol", "requeue", plan.slurm_job_id]
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        reason = str(error)
    else:
        if completed.returncode == 0:
            logger.info("Requeued SLURM job %s (scontrol requeue): it continues with --resume auto", plan.slurm_job_id)
            return True
        output = (completed.stderr or completed.stdout or "").strip().splitlines()
        reason = f"exit status {completed.returncode}" + (f": {output[-1]}" if output else "")
    logger.warning(
        "Could not requeue SLURM job %s (%s: %s); the checkpoint is saved: submit the job again, its --resume auto "
        "continues the run",
        plan.slurm_job_id,
        " ".join(command),
        reason,
    )
    return False


def stop_when_orphaned(signum: int = signal.SIGTERM, poll_interval_s: float = POLL_INTERVAL_S) -> None:
    """Send ``signum`` to this process, with one warning that says why, as soon as its parent (the launcher) is gone:
    a daemon thread compares the parent PID every ``poll_interval_s``."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_interval_s)
        logger.warning(
            "The launcher (PID %d) is gone; stopping this worker as for %s", parent, signal.Signals(signum).name
        )
        os.kill(os.getpid(), signum)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()
