"""Validation during training: the Dice score that every rank steps on, and its report on global rank 0.

Every rank scores its part of the validation set with the unwrapped model, and the sums are all-reduced, so every rank
gets the scores of the whole set (ReduceLROnPlateau must step identically everywhere). ``--val-mode rank0`` (the
default): rank 0's part is the whole set and the others have none: they wait in the all-reduce while rank 0 scores.
``--val-mode sharded``: every rank scores its own part (``utils.evaluation.shard_range``). Either way a file that
fails to load stops every rank with its message.

A stop signal during a rank-0 validation ends it at the next batch, so that the trained state is saved at once, not
after it: with a short grace period (SLURM's, Kubernetes') a validation that runs to its end, followed by one more
training batch, can lose the whole trained epoch. Rank 0 scores batches only while no signal has arrived
(``UntilStopped``); when one arrives, the partial score is dropped, every rank learns the signal from a second
all-reduce, and the loop saves ``INTERRUPTED.pth`` with the position of the
epoch's last step (every batch trained, the validation not done). The resumed run has no batch of that epoch left,
so it goes straight to the epoch's end and repeats the validation.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from utils.evaluation import score_batches
from utils.launch.process_group import DistributedContext, agree_on_errors, sum_across_ranks
from utils.launch.signals import InterruptFlag
from utils.training.run_log import RunLog

if TYPE_CHECKING:
    from utils.training.loop import TrainParts


@dataclass
class UntilStopped:
    """``loader``'s batches while ``flag`` (None: never) has recorded no signal; ``stopped_by`` tells which signal
    ended them. Its length is the loader's (the progress bar's total)."""

    loader: Any
    flag: InterruptFlag | None
    stopped_by: int = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            if self.flag is not None and self.flag.signum:
                # Stop before computing on the batch; leaving the loop lets the loader shut its workers down.
                self.stopped_by = self.flag.signum
                return
            yield batch


@dataclass
class Validator:
    """Scores the run's evaluated model (``TrainParts.evaluated_model``, unwrapped: no DDP collective; in eval mode:
    BatchNorm untouched) on ``parts.loaders.val``, this rank's part of the validation set (all of it on rank 0 with
    --val-mode rank0, nothing on the others), in the step's precision; reported at ``parts.position`` by the
    ``RunLog``."""

    ctx: DistributedContext
    parts: TrainParts
    interrupts: InterruptFlag
    run_log: RunLog

    def validate(self) -> tuple[float | None, int]:
        """The validation Dice and 0, the same on every rank; or None and the signal that cut rank 0's validation short
        (a partial score is no score: not reported). A file that failed to load raises its DatasetError on every
        rank."""
        ctx, loaders = self.ctx, self.parts.loaders
        # Only a rank-0 validation stops at a signal: with --val-mode sharded every rank scores its part to the end.
        batches = UntilStopped(loaders.val or [], None if loaders.val_sharded else self.interrupts)
        with self.run_log.phase("validation"):
            # Agreed before the all-reduce: a rank whose file failed would never reach it, and the others wait.
            metrics = agree_on_errors(
                ctx,
                lambda: score_batches(
                    self.parts.evaluated_model,
                    batches,
                    ctx.device,
                    n_classes=self.parts.config.model.classes,
                    precision=self.parts.step.precision,
                    progress=self.run_log.bars,
                ),
            )
            metrics.reduce(lambda sums: sum_across_ranks(ctx, sums.to(ctx.device)))
            # Asked before scoring: a signal before the first batch leaves no image scored, which is a stop, not an
            # empty validation set. Only rank 0 can have one: the sum is its signal.
            stopped = int(sum_across_ranks(ctx, torch.tensor([batches.stopped_by], device=ctx.device)).item())
            if stopped:
                return None, stopped
            result = metrics.compute()
            if ctx.is_main:
                self.run_log.log_val(result)
        return result.dice, 0
