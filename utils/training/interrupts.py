"""Graceful stop on SIGINT/SIGTERM: the handler only records the signal; the training loop decides when to stop.

torchrun forwards SIGINT/SIGTERM to its workers, a terminal's Ctrl-C reaches every process of the job, and a cluster
scheduler may signal only some ranks. So at every optimizer-step boundary the ranks agree on ``max(signal)`` with a
one-integer all-reduce on the CPU control group. The all-reduce is started asynchronously and read one step later:
the training loop never waits for it, and every rank still sees the same answer at the same step, so all of them stop
together, rank 0 writes ``INTERRUPTED.pth`` and each process exits with ``128 + signal`` (130 for SIGINT, 143 for
SIGTERM).

Under SLURM the requeue signal (``--requeue-signal``, SIGUSR1 by default) is handled the same way when ``install`` is
given it; after the stop, rank 0 requeues the job (``utils.training.requeue``).

The same all-reduce carries rank 0's wish to save by wall time (--save-every-minutes): only rank 0 reads its clock,
and every rank learns its decision at the same step boundary, so all of them save at the same step.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from utils.distributed import DistributedContext
from utils.runner import signal_exit_code as exit_code_for  # the exit status is the runner's (utils/runner.py)

__all__ = ["HANDLED_SIGNALS", "InterruptFlag", "StopAgreement", "exit_code_for"]

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class InterruptFlag:
    """Records the first handled signal received while installed; later ones are ignored (the first one wins)."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}

    def install(self, extra: Sequence[int] = ()) -> InterruptFlag:
        """Handle SIGINT, SIGTERM and the ``extra`` signals (the requeue signal under SLURM)."""
        for signum in (*HANDLED_SIGNALS, *extra):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Nothing else here: the main thread may be inside a collective, a checkpoint write or the logging lock.
        if not self.signum:
            self.signum = signum

    def __enter__(self) -> InterruptFlag:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.restore()


class StopAgreement:
    """Makes every rank see the same stop decision at the same step boundary, without blocking the step."""

    def __init__(self, ctx: DistributedContext, flag: InterruptFlag) -> None:
        self._ctx = ctx
        self._flag = flag
        self._pending: tuple[Any, torch.Tensor] | None = None
        self.save_agreed = False
        """Set by ``poll``: whether a rank asked to save (``save_due``) at the boundary whose answer arrived."""

    def poll(self, *, save_due: bool = False) -> int:
        """The signal all ranks agree to stop for (0 = keep going); call once per step boundary on every rank.

        ``save_due``: this rank asks every rank to save; ``save_agreed`` tells whether any rank asked (with several
        processes the answer arrives at the next boundary, the same one on every rank).
        """
        if not self._ctx.is_distributed:
            self.save_agreed = save_due
            return self._flag.signum
        agreed = self._collect()
        local = torch.tensor([self._flag.signum, int(save_due)], dtype=torch.int32)
        work = dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self._ctx.control_group, async_op=True)
        self._pending = (work, local)
        return agreed

    def finish(self) -> int:
        """Complete the outstanding all-reduce (before any other collective on the control group) and return it."""
        return self._collect() if self._ctx.is_distributed else self._flag.signum

    def _collect(self) -> int:
        if self._pending is None:
            self.save_agreed = False
            return 0
        work, value = self._pending
        self._pending = None
        work.wait()
        signum, save = value.tolist()
        self.save_agreed = bool(save)
        return int(signum)
