"""The training loop: ``Trainer.train()`` runs epochs of optimizer steps and returns how the run ended.

Per optimizer step the loop does no host synchronisation: losses and the count of steps skipped for non-finite
gradients (``TrainStep``, ``utils.training.nonfinite``) accumulate on the device and are read every ``--log-every``
steps and at checkpoints, and the ranks' stop decision travels on an asynchronous CPU all-reduce
(``utils.training.interrupts``). The one wait between ranks it adds is on the CPU: before computing on a batch,
the ranks agree that each of them loaded its own (``Trainer._batches``; about 85 us per batch with 2 local processes).
Validation runs on global rank 0 with the unwrapped model while the other ranks wait for its Dice score, which every
rank then uses (ReduceLROnPlateau must step identically everywhere).
The loop tells its ``Checkpointer`` (``utils.checkpoint.checkpointer``) where it stands at every step and epoch
boundary; what to save, when, and whether the state is healthy enough to be saved is decided there.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from utils.checkpoint.checkpointer import Checkpointer
from utils.checkpoint.run_folder import RunFolder
from utils.checkpoint.state import TrainPosition
from utils.distributed import (
    DistributedContext,
    agree_on_errors,
    barrier,
    broadcast_from_main,
    raised_on_every_rank,
    sum_across_ranks,
)
from utils.errors import DatasetError, UserError, user_message
from utils.evaluation import EvalResult, SegmentationMetrics, predict_classes, score_batches
from utils.training.curves import write_curves_if_possible
from utils.training.data import TrainData
from utils.training.early_stop import EarlyStopping
from utils.training.ema import WeightAverage
from utils.training.interrupts import InterruptFlag, StopAgreement
from utils.training.progress_log import ProgressLog, bars_wanted
from utils.training.reporting import SAMPLE_IMAGES, RunReporter, weight_and_grad_histograms
from utils.training.sampler import BatchPlan, ResumableDistributedSampler
from utils.training.step import TrainStep
from utils.training.validation_stop import StoppedValidation, UntilStopped, ValidationStopped
from utils.wording import count

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopConfig:
    """When the loop validates, saves, logs and stops (from the epoch, checkpoint and logging flags).

    No field has a default: ``setup.loop_config`` fills every one from the flags, whose defaults are the only ones."""

    last_epoch: int
    """Number of the last epoch to train (epochs are numbered from 1)."""
    n_classes: int
    val_every: int
    save_every: int
    """checkpoint_epoch{N}.pth every this many epochs (0 = never)."""
    keep_last: int
    save_every_steps: int
    log_every: int
    max_steps: int
    max_nonfinite_steps: int
    save_every_minutes: float
    """Also save last.pth when this many minutes have passed since the last save (0 = off)."""
    keep_best: int
    """Keep the K best states by validation Dice as best-1.pth .. best-K.pth (0 = off)."""
    plateau_scheduler: bool
    """The scheduler steps on validation Dice (ReduceLROnPlateau) instead of after every optimizer step."""
    no_progress: bool
    """No progress bars even on a terminal: log lines instead (``utils.training.progress_log``)."""
    sharded_validation: bool
    """--val-mode sharded: every rank scores its part of the validation set and the sums are all-reduced."""
    early_stopping: EarlyStopping
    """--patience/--min-delta."""


@dataclass
class TrainParts:
    """Everything the loop works on, built (and restored from a checkpoint) by ``utils.training.setup``."""

    raw_model: nn.Module
    """The plain UNet: evaluated, and saved in checkpoints."""
    step: TrainStep
    """The optimizer step; it holds the model as the forward pass calls it (DDP and/or compiled)."""
    scheduler: Any
    precision: str
    data: TrainData
    sampler: ResumableDistributedSampler
    train_loader: DataLoader
    val_loader: DataLoader | None
    batch_plan: BatchPlan
    model_args: dict[str, Any]
    run_args: dict[str, Any]
    """The run's flags as a plain dict, stored in every checkpoint."""
    position: TrainPosition
    resume_images_in_epoch: int
    """Global images of epoch ``position.epoch`` already trained by the run this one resumes."""
    ema: WeightAverage | None = None
    """--ema: the average of the weights, updated after every applied step; it validates and is saved as the model."""


@dataclass
class TrainOutcome:
    """How ``train()`` ended: completed, stopped by --max-steps, or interrupted by a signal (then a checkpoint)."""

    position: TrainPosition
    interrupted_by: int = 0
    checkpoint: Path | None = None
    """The file holding the final state; None when it could not be saved (the latest step was skipped)."""
    reached_max_steps: bool = False
    stopped_early: str | None = None
    """--patience: why the run stopped early (its last line)."""


class Trainer:
    def __init__(
        self,
        config: LoopConfig,
        ctx: DistributedContext,
        parts: TrainParts,
        *,
        run_folder: RunFolder,
        reporter: RunReporter,
        interrupts: InterruptFlag,
    ) -> None:
        self.config = config
        self.ctx = ctx
        self.parts = parts
        self.step = parts.step
        self.run_folder = run_folder
        self.reporter = reporter
        self.position = parts.position
        self._stop = StopAgreement(ctx, interrupts)
        self._interrupts = interrupts  # read during validation (utils.training.validation_stop)
        self._plan = parts.batch_plan
        self._images_seen = self.position.global_step * self._plan.images_per_step
        self._last_log = (time.perf_counter(), self._images_seen)
        self.checkpointer = Checkpointer(
            config, ctx, run_folder, parts, skipped_steps=self._check_skipped_steps, phase=reporter.phase
        )
        self._bars = bars_wanted(is_main=ctx.is_main, no_progress=config.no_progress)
        self._progress_log = ProgressLog(
            enabled=ctx.is_main and not self._bars,
            last_epoch=config.last_epoch,
            steps_per_epoch=self._plan.steps_per_epoch,
            max_steps=config.max_steps,
        )
        # Losses of an epoch's last steps, read at its end for the epoch line and counted into the next log window.
        self._loss_carry = [0.0, 0.0]
        self._last_validation: tuple[float, float] | None = None

    # ---------------------------------------------------------------------------------------------------- public

    def train(self) -> TrainOutcome:
        outcome = None
        self.parts.raw_model.train()
        self._progress_log.start(self.position.global_step)
        self.reporter.mark("loop_start")  # the benchmark's epoch section: start-up ends here
        self.checkpointer.log_budget(self.config.last_epoch)
        # Log lines are written above the progress bars instead of being glued onto them.
        with logging_redirect_tqdm():
            while outcome is None and self.position.epoch < self.config.last_epoch:
                if self._max_steps_reached():
                    outcome = self._stop_for_max_steps()
                    break
                outcome = self._run_epoch(self.position.epoch)
                if outcome is None:
                    outcome = self._end_epoch(self.position.epoch)
        self._check_skipped_steps()
        self._stop.finish()
        with self.reporter.phase("curves"):
            drawn = self.reporter.enabled and write_curves_if_possible(
                self.reporter.metrics_path, self.reporter.curves_path
            )
        if drawn:
            logger.info("Curves written to %s", self.reporter.curves_path)
        # Nobody leaves before rank 0 has written its files: a launcher may kill the others' siblings on exit.
        barrier(self.ctx)
        return outcome or TrainOutcome(self.position)

    def close(self) -> None:
        """Close metrics.jsonl and the wandb run, and release the run folder's lock."""
        try:
            self.reporter.close()
        finally:
            self.run_folder.unlock()

    # --------------------------------------------------------------------------------------------------- epochs

    def _run_epoch(self, epoch: int) -> TrainOutcome | None:
        """Train the remaining batches of ``epoch``; an outcome when the run must stop before the epoch's end."""
        plan = self._plan
        images_done = self._images_done_in_epoch()
        self.parts.sampler.set_epoch(epoch, consumed=images_done)
        self.parts.data.train_dataset.set_epoch(epoch)
        self.step.set_epoch(epoch)  # --freeze-encoder-epochs
        batches_done = plan.batches_done(images_done)
        batches_in_epoch = plan.batches_in_epoch(images_done)
        # The bar counts global images (all ranks), the unit users reason in: exactly those this epoch trains (with
        # several ranks the sampler pads the epoch to a multiple of the world size), so it ends at 100%.
        progress = tqdm(
            total=images_done + plan.images_per_rank(images_done) * plan.world_size,
            initial=images_done,
            desc=f"Epoch {epoch + 1}/{self.config.last_epoch}",
            unit="img",
            disable=not self._bars,
            dynamic_ncols=True,
        )
        try:
            for offset, batch in enumerate(self._batches()):
                index = batches_done + offset
                group = plan.accumulation_group(index, batches_in_epoch)
                closes_group = group.closes_with(index)
                # A resume whose batch size or world size changed may start inside a group: it opens a step too.
                if group.opens_with(index) or offset == 0:
                    self.step.begin()
                images = self.step.accumulate(batch, group.size, sync_gradients=closes_group)
                self._images_seen += images * self.ctx.world_size
                progress.update(images * self.ctx.world_size)
                if not closes_group:
                    continue
                self.step.update()
                if self.parts.ema is not None:
                    self.parts.ema.update()
                self.position.global_step += 1
                self.position.step_in_epoch = index + 1
                outcome = self._after_step(epoch, progress)
                if outcome is not None:
                    return outcome
        except DatasetError as error:
            # A worker's error re-raised here carries the loader's iterator in its traceback. Dropping the traceback
            # lets the iterator shut its workers down now; kept alive with the error, its idle workers (which ignore
            # SIGTERM, see utils.training.data) would block the interpreter's exit forever.
            error.__traceback__ = None
            self._stop_for_bad_data(user_message(error))
        finally:
            progress.close()
        return None

    def _batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """The epoch's batches of this rank; a file that fails to load on any rank raises its error on every rank.

        With several processes a rank whose batch failed cannot join the gradient all-reduce the others wait in, so
        the ranks agree on every fetch before any of them computes on it (one integer all-reduce on the CPU control
        group per batch, next to a forward and backward pass). Every sampler gives every rank the same number of
        batches, so all of them reach the end of the epoch together.
        """
        iterator = iter(self.parts.train_loader)
        while True:
            batch = agree_on_errors(self.ctx, functools.partial(_next_batch, iterator))
            if batch is None:
                return
            yield batch

    def _images_done_in_epoch(self) -> int:
        """Global images of ``epoch`` trained before this process started (only the resumed epoch has any)."""
        done, self.parts.resume_images_in_epoch = self.parts.resume_images_in_epoch, 0
        return done

    def _end_epoch(self, epoch: int) -> TrainOutcome | None:
        """Validate, save, and stop early (--patience) when the validations stopped improving."""
        epoch_number = epoch + 1
        trained_steps = self.position.step_in_epoch  # kept for a stop during validation
        self.position.epoch = epoch_number
        self.position.step_in_epoch = 0
        improved, dice = False, None
        # Every rank reads the epoch's remaining losses here (a collective), whether or not it logs.
        remainder = sum_across_ranks(self.ctx, self.step.take_losses()).tolist()
        self._progress_log.add_losses(*remainder)
        self._loss_carry = [carried + value for carried, value in zip(self._loss_carry, remainder, strict=True)]
        self._last_validation = None
        if self._should_validate(epoch_number):
            try:
                with self.reporter.phase("validation"):
                    dice = self._validate(epoch_number)
            except ValidationStopped as stop:
                # Saved as "every batch trained, not validated": the resumed run repeats the validation.
                self.position.epoch, self.position.step_in_epoch = epoch, trained_steps
                return self._stop_for_signal(stop.signum)
            if self.config.plateau_scheduler:
                self.parts.scheduler.step(dice)
            self.position.validations_without_improvement = self.config.early_stopping.validations_without_improvement(
                dice, self.position.best_dice, self.position.validations_without_improvement
            )
            improved = dice > self.position.best_dice
            if improved:
                self.position.best_dice, self.position.best_epoch = dice, epoch_number
        self._progress_log.epoch_line(
            epoch_number=epoch_number, global_step=self.position.global_step, validation=self._last_validation
        )
        self.checkpointer.save_epoch(epoch_number, dice, improved=improved)
        stale = self.position.validations_without_improvement
        if self.config.early_stopping.should_stop(stale) and epoch_number < self.config.last_epoch:
            reason = self.config.early_stopping.reason(self.position.best_dice, self.position.best_epoch)
            return TrainOutcome(self.position, checkpoint=self.run_folder.last, stopped_early=reason)
        return None

    def _should_validate(self, epoch_number: int) -> bool:
        return epoch_number % self.config.val_every == 0 or epoch_number == self.config.last_epoch

    # ---------------------------------------------------------------------------------------------------- steps

    def _after_step(self, epoch: int, progress: tqdm) -> TrainOutcome | None:
        """Logging, step checkpoints, and the stop decisions due at this optimizer-step boundary."""
        step = self.position.global_step
        if step % self.config.log_every == 0:
            self._log_train(epoch, progress)
        self.checkpointer.save_if_due()
        signum = self._stop.poll(save_due=self.checkpointer.timed_save_due())
        if self._stop.save_agreed and not signum:
            # Every rank got the same answer at this boundary, so all of them save here together.
            self.checkpointer.save_timed()
        if signum:
            return self._stop_for_signal(signum)
        if self._max_steps_reached():
            return self._stop_for_max_steps()
        return None

    def _max_steps_reached(self) -> bool:
        return bool(self.config.max_steps) and self.position.global_step >= self.config.max_steps

    # ---------------------------------------------------------------------------------------------------- stops

    def _stop_for_signal(self, signum: int) -> TrainOutcome:
        return TrainOutcome(self.position, interrupted_by=signum, checkpoint=self.checkpointer.save_now("interrupted"))

    def _stop_for_bad_data(self, message: str) -> NoReturn:
        """A file that failed to load mid-run, on any rank: every rank saves INTERRUPTED.pth together (nothing trained
        is lost: the state of the last whole optimizer step), then stops with the file's error."""
        where = self.checkpointer.save_now("interrupted")
        kept = (
            f"saved {where} (step {self.position.global_step})"
            if where
            else f"the newest checkpoint in {self.run_folder} holds the last saved state"
        )
        error = DatasetError(
            f"{message}; {kept}: continue with --resume auto once the file is fixed (a removed file changes the "
            f"dataset, which a resume refuses: then start from that checkpoint with --load)"
        )
        raise raised_on_every_rank(error)

    def _stop_for_max_steps(self) -> TrainOutcome:
        logger.info("Reached --max-steps %d", self.config.max_steps)
        return TrainOutcome(self.position, reached_max_steps=True, checkpoint=self.checkpointer.save_now("last"))

    # -------------------------------------------------------------------------------------- non-finite steps

    def _check_skipped_steps(self) -> int:
        """Report skipped steps; stop the run at --max-nonfinite-steps in a row. Returns the current run of them.

        Reads the device: call only where the loop synchronises anyway. Every rank counts the same steps (the
        gradients were all-reduced), so all of them stop at the same point without a collective.
        """
        report = self.step.skip_report()
        if report is None:
            return 0
        step = self.position.global_step
        if report.skipped and self.ctx.is_main:
            logger.warning(
                "%d optimizer step(s) up to step %d had NaN or inf gradients and were skipped (weights unchanged)",
                report.skipped,
                step,
            )
        limit = self.config.max_nonfinite_steps
        if limit and report.longest_run >= limit:
            diverged = UserError(
                f"training diverged: {report.longest_run} optimizer steps in a row (up to step {step}) had NaN or inf "
                f"loss or gradients and were skipped; the newest checkpoint in {self.run_folder} (if any) holds the "
                f"last good state. Lower --learning-rate, keep --grad-clip on, check the data, or raise "
                f"--max-nonfinite-steps (now {limit})"
            )
            raise raised_on_every_rank(diverged)  # every rank counts the same steps
        return report.current_run

    # ---------------------------------------------------------------------------------------------- validation

    @property
    def _evaluated_model(self) -> nn.Module:
        """What validates: the average of the weights with --ema, else the unwrapped model."""
        return self.parts.ema.module if self.parts.ema is not None else self.parts.raw_model

    def _score(self, batches: Iterable[dict[str, torch.Tensor]]) -> SegmentationMetrics:
        """The validation sums over ``batches`` (one shard, or the whole set on rank 0), not yet scored."""
        return score_batches(
            self._evaluated_model,  # unwrapped and in eval mode: no DDP collective, BatchNorm untouched
            batches,
            self.ctx.device,
            n_classes=self.config.n_classes,
            precision=self.parts.precision,
            progress=self._bars,
        )

    def _validate(self, epoch_number: int) -> float:
        """Validation Dice of the unwrapped model, computed on rank 0 and broadcast to every rank."""
        if self.config.sharded_validation and self.ctx.is_distributed:
            return self._validate_sharded(epoch_number)
        dice: float | str | StoppedValidation | None = None
        if self.ctx.is_main:
            batches = UntilStopped(self.parts.val_loader, self._interrupts)
            try:
                metrics = self._score(batches)
            except DatasetError as error:
                error.__traceback__ = None  # it holds the loader's iterator: see _run_epoch
                dice = user_message(error)  # every rank learns of it from the broadcast and stops with it
            else:
                # Asked before computing: a signal before the first batch leaves no image scored, which is a stop,
                # not an empty validation set.
                if batches.stopped_by:
                    dice = StoppedValidation(batches.stopped_by)  # a partial score is no score: not reported
                else:
                    result = metrics.compute()
                    self._report_validation(epoch_number, result)
                    dice = result.dice
        # The broadcast is also the barrier: the other ranks wait here while rank 0 evaluates.
        dice = broadcast_from_main(self.ctx, dice)
        if isinstance(dice, str):
            self._stop_for_bad_data(dice)
        if isinstance(dice, StoppedValidation):
            raise ValidationStopped(dice.signum)
        return float(dice)

    def _validate_sharded(self, epoch_number: int) -> float:
        """Every rank scores its part (``utils.evaluation.shard_range``); the sums are all-reduced, so every rank
        gets the scores of the whole set. A file that fails on any rank stops every rank with its message."""
        try:
            # Agreed before the all-reduce: a rank whose file failed would never reach it, and the others would wait.
            metrics = agree_on_errors(self.ctx, lambda: self._score(self.parts.val_loader))
        except DatasetError as error:
            error.__traceback__ = None  # it holds the loader's iterator: see _run_epoch
            self._stop_for_bad_data(user_message(error))
        metrics.reduce(lambda sums: sum_across_ranks(self.ctx, sums.to(self.ctx.device)))
        result = metrics.compute()
        if self.ctx.is_main:
            self._report_validation(epoch_number, result)
        return result.dice

    def _report_validation(self, epoch_number: int, result: EvalResult) -> None:
        per_class = ", ".join(
            f"{k}: Dice {d:.4f} IoU {i:.4f}"
            for k, (d, i) in enumerate(zip(result.per_class_dice, result.per_class_iou, strict=True))
        )
        micro = result.reductions()["micro"]
        self._last_validation = (result.dice, result.iou)
        logger.info(
            "Validation after epoch %d (step %d, %s): Dice %.4f, IoU %.4f [%s] (macro: per-image means; "
            "the means average classes 1+); micro (dataset-level) Dice %.4f, IoU %.4f",
            epoch_number,
            self.position.global_step,
            count(result.n_images, "image"),
            result.dice,
            result.iou,
            per_class,
            micro["dice"],
            micro["iou"],
        )
        samples = self._wandb_samples() if self.reporter.wants_samples() else None
        self.reporter.log_val(epoch=epoch_number, global_step=self.position.global_step, result=result, samples=samples)
        # Redrawn after every validation, so a long run's curves.png is always current.
        with self.reporter.phase("curves"):
            write_curves_if_possible(self.reporter.metrics_path, self.reporter.curves_path)

    @torch.inference_mode()
    def _wandb_samples(self) -> dict[str, Any]:
        """A few validation images with their true and predicted masks, plus weight/gradient histograms."""
        batch = next(iter(self.parts.val_loader))
        model = self._evaluated_model
        model.eval()
        try:
            logits = model(batch["image"][:SAMPLE_IMAGES].to(self.ctx.device))
        finally:
            model.train()
        return {
            "image": batch["image"][:SAMPLE_IMAGES],
            "true": batch["mask"][:SAMPLE_IMAGES],
            "pred": predict_classes(logits),
            "histograms": weight_and_grad_histograms(model),
        }

    # ------------------------------------------------------------------------------------------------- logging

    def _log_train(self, epoch: int, progress: tqdm) -> None:
        # The only host synchronisation of the loop: one small all-reduce and read every --log-every steps.
        window = sum_across_ranks(self.ctx, self.step.take_losses()).tolist()
        self._progress_log.add_losses(*window)
        loss_sum, count = (value + carried for value, carried in zip(window, self._loss_carry, strict=True))
        self._loss_carry = [0.0, 0.0]
        self._check_skipped_steps()
        now = time.perf_counter()
        last_time, last_images = self._last_log
        images_per_s = (self._images_seen - last_images) / max(now - last_time, 1e-9)
        self._last_log = (now, self._images_seen)
        loss = loss_sum / count if count else float("nan")
        lr = self.step.optimizer.param_groups[0]["lr"]
        progress.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)
        self._progress_log.step_line(
            epoch=epoch,
            global_step=self.position.global_step,
            step_in_epoch=self.position.step_in_epoch,
            loss=loss,
            lr=lr,
            images_per_s=images_per_s,
        )
        self.reporter.log_train(
            epoch=epoch + 1,
            global_step=self.position.global_step,
            loss=loss,
            lr=lr,
            images_per_s=images_per_s,
            images_seen=self._images_seen,
        )


def _next_batch(iterator: Iterator[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
    """The next batch (None at the end); a load failure as a DatasetError holding just its message.

    The message is what the other ranks receive, so a DataLoader worker's traceback text is cut off here; and the new
    error holds no traceback through the loader's iterator (see ``Trainer._run_epoch``).
    """
    try:
        return next(iterator, None)
    except DatasetError as error:
        error.__traceback__ = None
        message = user_message(error)
    raise DatasetError(message)
