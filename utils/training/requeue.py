"""Requeue at the time limit: under SLURM, a signal sent before the limit saves the run and puts the job back in the
queue, and the requeued job's ``--resume auto`` continues it.

``#SBATCH --signal=USR1@120`` makes SLURM send SIGUSR1 to every task 120 s before the time limit. The handler only
records it (``utils.training.interrupts``: saving inside a handler can hang, Lightning #21406); the ranks agree on the
step to stop at, rank 0 writes ``INTERRUPTED.pth`` (the full state), and once every rank has left the loop rank 0
alone runs ``scontrol requeue $SLURM_JOB_ID`` once. SLURM then ends the job's tasks and queues the same script again.
A missing or failing ``scontrol`` is one warning: the checkpoint is there and a manual resubmission continues it.
SLURM's own ``--requeue`` covers pre-emption and node failure, not the time limit. docs/CLUSTERS.md.
"""

from __future__ import annotations

import logging
import signal
import subprocess
from collections.abc import Callable
from typing import Any

from utils.distributed import DistributedContext

logger = logging.getLogger(__name__)

SCONTROL_TIMEOUT_S = 60.0


def requeue_signal(name: str, slurm_job_id: str | None) -> int | None:
    """The signal that requeues this run (``--requeue-signal``), None outside a SLURM job or when it is 'none'."""
    if slurm_job_id is None or name == "none":
        return None
    return int(getattr(signal, f"SIG{name}"))


def signals_to_handle(name: str, slurm_job_id: str | None) -> list[int]:
    """The extra signals ``InterruptFlag.install`` handles: the requeue signal inside a SLURM job, else none."""
    signum = requeue_signal(name, slurm_job_id)
    return [] if signum is None else [signum]


def requeue_if_asked(ctx: DistributedContext, stopped_by: int, signal_name: str) -> bool:
    """On global rank 0, once the run stopped for the requeue signal: requeue the job; whether it was requeued.

    Called after ``Trainer.train`` returned, whose final barrier means every rank has left the loop and rank 0 has
    written its files. Also when the stop could not save (a skipped step): the newest checkpoint is then older, and
    the requeued job still continues from it.
    """
    signum = requeue_signal(signal_name, ctx.slurm_job_id)
    if not ctx.is_main or ctx.slurm_job_id is None or signum is None or stopped_by != signum:
        return False
    return requeue_job(ctx.slurm_job_id)


def requeue_job(slurm_job_id: str, *, run: Callable[..., Any] = subprocess.run) -> bool:
    """Run ``scontrol requeue JOB`` once; False (after one warning) when it is missing or fails."""
    command = ["scontrol", "requeue", slurm_job_id]
    try:
        completed = run(command, capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        reason = str(error)
    else:
        if completed.returncode == 0:
            logger.info("Requeued SLURM job %s (scontrol requeue): it continues with --resume auto", slurm_job_id)
            return True
        output = (completed.stderr or completed.stdout or "").strip().splitlines()
        reason = f"exit status {completed.returncode}" + (f": {output[-1]}" if output else "")
    logger.warning(
        "Could not requeue SLURM job %s (%s: %s); the checkpoint is saved: submit the job again, its --resume auto "
        "continues the run",
        slurm_job_id,
        " ".join(command),
        reason,
    )
    return False
