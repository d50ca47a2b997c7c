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

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from utils.errors import DatasetError, count, user_message
from utils.evaluation import EvalResult, SegmentationMetrics, predict_classes, score_batches
from utils.launch.process_group import (
    DistributedContext,
    agree_on_errors,
    broadcast_from_main,
    raised_on_every_rank,
    sum_across_ranks,
)
from utils.launch.signals import InterruptFlag
from utils.training.run_log import SAMPLE_IMAGES, RunLog, weight_and_grad_histograms

logger = logging.getLogger(__name__)


class ValidationStopped(Exception):
    """Raised on every rank by ``Validator.validate`` when a signal, ``signum``, cut rank 0's validation short."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)  # the constructor's own arguments: rank 0 broadcasts it pickled
        self.signum = signum


class UntilStopped:
    """``loader``'s batches while ``flag`` has recorded no signal; ``stopped_by`` tells which signal ended it."""

    def __init__(self, loader: Iterable[Any], flag: InterruptFlag) -> None:
        self._loader = loader
        self._flag = flag
        self.stopped_by = 0

    def __len__(self) -> int:
        return len(self._loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        for batch in self._loader:
            if self._flag.signum:
                # Stop before computing on the batch; leaving the loop lets the loader shut its workers down.
                self.stopped_by = self._flag.signum
                return
            yield batch


class Validator:
    """Scores ``model`` (unwrapped: no DDP collective; in eval mode: BatchNorm untouched) on ``loader``, this rank's
    part of the validation set (all of it on rank 0 with --val-mode rank0, nothing on the others).

    ``sharded``: every rank scores its own part and the sums are all-reduced (``Loaders.val_sharded``, which decided
    the loaders)."""

    def __init__(
        self,
        ctx: DistributedContext,
        model: nn.Module,
        loader: Iterable[dict[str, torch.Tensor]] | None,
        *,
        sharded: bool,
        n_classes: int,
        precision: str,
        interrupts: InterruptFlag,
        run_log: RunLog,
    ) -> None:
        self.ctx = ctx
        self.model = model
        self.loader = loader
        self.sharded = sharded
        self._n_classes = n_classes
        self._precision = precision
        self._interrupts = interrupts
        self._run_log = run_log

    def validate(self, epoch_number: int, global_step: int) -> float:
        """The validation Dice, the same on every rank; raises ``ValidationStopped`` (a signal cut rank 0's short) or
        a ``DatasetError`` (a file failed to load) on every rank."""
        with self._run_log.phase("validation"):
            if self.sharded:
                # Agreed before the all-reduce: a rank whose file failed would never reach it, and the others wait.
                metrics = agree_on_errors(self.ctx, lambda: self._score(self.loader))
                metrics.reduce(lambda sums: sum_across_ranks(self.ctx, sums.to(self.ctx.device)))
                result = metrics.compute()
                if self.ctx.is_main:
                    self._report(epoch_number, global_step, result)
                return result.dice
            # The broadcast is also the barrier: the other ranks wait here while rank 0 evaluates.
            dice = broadcast_from_main(self.ctx, self._on_main(epoch_number, global_step) if self.ctx.is_main else None)
        if isinstance(dice, Exception):
            raise dice  # rank 0's, on every rank
        return float(dice)

    def _on_main(self, epoch_number: int, global_step: int) -> float | DatasetError | ValidationStopped:
        """Rank 0's part of a --val-mode rank0 validation: its Dice, or the error every rank raises (a file that
        failed to load, or the stop)."""
        batches = UntilStopped(self.loader, self._interrupts)
        try:
            metrics = self._score(batches)
        except DatasetError as error:
            # It holds the loader's iterator, whose idle workers would block the exit: see Trainer.train.
            error.__traceback__ = None
            return raised_on_every_rank(DatasetError(user_message(error)))  # its message alone travels
        # Asked before computing: a signal before the first batch leaves no image scored, which is a stop, not an
        # empty validation set.
        if batches.stopped_by:
            return ValidationStopped(batches.stopped_by)  # a partial score is no score: not reported
        result = metrics.compute()
        self._report(epoch_number, global_step, result)
        return result.dice

    def _score(self, batches: Iterable[dict[str, torch.Tensor]]) -> SegmentationMetrics:
        """The validation sums over ``batches`` (one shard, or the whole set on rank 0), not yet scored."""
        return score_batches(
            self.model,
            batches,
            self.ctx.device,
            n_classes=self._n_classes,
            precision=self._precision,
            progress=self._run_log.bars,
        )

    def _report(self, epoch_number: int, global_step: int, result: EvalResult) -> None:
        per_class = ", ".join(
            f"{k}: Dice {d:.4f} IoU {i:.4f}"
            for k, (d, i) in enumerate(zip(result.per_class_dice, result.per_class_iou, strict=True))
        )
        micro = result.reductions()["micro"]
        logger.info(
            "Validation after epoch %d (step %d, %s): Dice %.4f, IoU %.4f [%s] (macro: per-image means; "
            "the means average classes 1+); micro (dataset-level) Dice %.4f, IoU %.4f",
            epoch_number,
            global_step,
            count(result.n_images, "image"),
            result.dice,
            result.iou,
            per_class,
            micro["dice"],
            micro["iou"],
        )
        samples = self._samples() if self._run_log.wants_samples() else None
        self._run_log.log_val(epoch=epoch_number, global_step=global_step, result=result, samples=samples)

    @torch.inference_mode()
    def _samples(self) -> dict[str, Any]:
        """A few validation images with their true and predicted masks, plus weight/gradient histograms."""
        batch = next(iter(self.loader))
        self.model.eval()
        try:
            logits = self.model(batch["image"][:SAMPLE_IMAGES].to(self.ctx.device))
        finally:
            self.model.train()
        return {
            "image": batch["image"][:SAMPLE_IMAGES],
            "true": batch["mask"][:SAMPLE_IMAGES],
            "pred": predict_classes(logits),
            "histograms": weight_and_grad_histograms(self.model),
        }
