"""Validation during training: the Dice score that every rank steps on, and its report on global rank 0.

``--val-mode rank0`` (the default): rank 0 scores the whole validation set with the unwrapped model while the other
ranks wait for its Dice score, which every rank then uses (ReduceLROnPlateau must step identically everywhere).
``--val-mode sharded``: every rank scores its part (``utils.evaluation.shard_range``) and the sums are all-reduced, so
every rank gets the scores of the whole set. Either way a file that fails to load stops every rank with its message.

A stop signal during a rank-0 validation ends it at the next batch, so that the trained state is saved at once, not
after it: with a short grace period (SLURM's, Kubernetes') a validation that runs to its end, followed by one more
training batch, can lose the whole trained epoch. Rank 0 scores batches only while no signal has arrived
(``UntilStopped``); when one arrives, the partial score is dropped, every rank learns it from the score broadcast
and raises it (``ValidationStopped``), and the loop saves ``INTERRUPTED.pth`` with the position of
the epoch's last step (every batch trained, the validation not done). The resumed run has no batch of that epoch
left, so it goes straight to the epoch's end and repeats the validation.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from utils.errors import DatasetError, user_message
from utils.evaluation import SegmentationMetrics, score_batches
from utils.launch.process_group import (
    DistributedContext,
    agree_on_errors,
    broadcast_from_main,
    raised_on_every_rank,
    sum_across_ranks,
)
from utils.launch.signals import InterruptFlag
from utils.training.run_log import RunLog

if TYPE_CHECKING:
    from utils.training.loop import TrainParts


class ValidationStopped(Exception):
    """Raised on every rank by ``Validator.validate`` when a signal cut rank 0's validation short; its one argument
    (rank 0 broadcasts it pickled) is the signal."""

    @property
    def signum(self) -> int:
        return self.args[0]


@dataclass
class UntilStopped:
    """``loader``'s batches while ``flag`` has recorded no signal, then ``ValidationStopped``; its length is the
    loader's (the progress bar's total)."""

    loader: Any
    flag: InterruptFlag

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            if self.flag.signum:
                raise ValidationStopped(self.flag.signum)  # before computing on the batch
            yield batch


class Validator:
    """Scores the run's evaluated model (``TrainParts.evaluated_model``, unwrapped: no DDP collective; in eval mode:
    BatchNorm untouched) on ``parts.loaders.val``, this rank's part of the validation set (all of it on rank 0 with
    --val-mode rank0, nothing on the others), in the step's precision; reported at ``parts.position`` by the
    ``RunLog``.

    ``Loaders.val_sharded`` (which decided the loaders): every rank scores its own part and the sums are
    all-reduced."""

    def __init__(
        self, ctx: DistributedContext, parts: TrainParts, *, interrupts: InterruptFlag, run_log: RunLog
    ) -> None:
        self.ctx = ctx
        self.parts = parts
        self._interrupts = interrupts
        self._run_log = run_log

    def validate(self) -> float:
        """The validation Dice, the same on every rank; raises ``ValidationStopped`` (a signal cut rank 0's short) or
        a ``DatasetError`` (a file failed to load) on every rank."""
        with self._run_log.phase("validation"):
            if self.parts.loaders.val_sharded:
                # Agreed before the all-reduce: a rank whose file failed would never reach it, and the others wait.
                metrics = agree_on_errors(self.ctx, lambda: self._score(self.parts.loaders.val))
                metrics.reduce(lambda sums: sum_across_ranks(self.ctx, sums.to(self.ctx.device)))
                result = metrics.compute()
                if self.ctx.is_main:
                    self._run_log.log_val(result)
                return result.dice
            # The broadcast is also the barrier: the other ranks wait here while rank 0 evaluates.
            dice = broadcast_from_main(self.ctx, self._on_main() if self.ctx.is_main else None)
        if isinstance(dice, Exception):
            raise dice  # rank 0's, on every rank
        return float(dice)

    def _on_main(self) -> float | DatasetError | ValidationStopped:
        """Rank 0's part of a --val-mode rank0 validation: its Dice, or the error every rank raises (a file that
        failed to load, or the stop)."""
        try:
            # A signal before the first batch leaves no image scored, which is a stop, not an empty validation set.
            result = self._score(UntilStopped(self.parts.loaders.val, self._interrupts)).compute()
        except DatasetError as error:
            # It holds the loader's iterator, whose idle workers would block the exit: see Trainer.train.
            error.__traceback__ = None
            return raised_on_every_rank(DatasetError(user_message(error)))  # its message alone travels
        except ValidationStopped as stop:
            return ValidationStopped(stop.signum)  # a partial score is no score: not reported; no traceback either
        self._run_log.log_val(result)
        return result.dice

    def _score(self, batches: Iterable[dict[str, torch.Tensor]]) -> SegmentationMetrics:
        """The validation sums over ``batches`` (one shard, or the whole set on rank 0), not yet scored."""
        return score_batches(
            self.parts.evaluated_model,
            batches,
            self.ctx.device,
            n_classes=self.parts.config.model.classes,
            precision=self.parts.step.precision,
            progress=self._run_log.bars,
        )
