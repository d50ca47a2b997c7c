"""The training loop: ``Trainer.train()`` runs epochs of optimizer steps and returns how the run ended.

The loop calls its components: the optimizer step (``utils.training.step``), the validation
(``utils.training.validation``), the run's log (``utils.training.run_log``) and the checkpoint writes. Per optimizer
step it does no host synchronisation: losses and the count of steps skipped for non-finite gradients
(``utils.training.nonfinite``) accumulate on the device and are read every ``--log-every`` steps and at checkpoints,
and the ranks' stop decision travels on an asynchronous CPU all-reduce (``StopAgreement``). The one wait
between ranks it adds is on the CPU: before computing on a batch, the ranks agree that each of them loaded its own
(``Trainer._batches``; about 85 us per batch with 2 local processes).
Checkpoints are written by global rank 0 only, and only of a healthy state: finite weights, and a latest step that
was not skipped.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn
from torch.utils.data import DataLoader

from utils.checkpoint import all_finite, copy_checkpoint_atomic, save_checkpoint_atomic
from utils.errors import DatasetError, UserError, user_message
from utils.launch.process_group import DistributedContext, StopAgreement, agree_on_errors, barrier, raised_on_every_rank
from utils.launch.signals import InterruptFlag
from utils.training import early_stop
from utils.training.checkpoint_budget import CheckpointBudget, checkpoint_budget, epoch_files_written, log_budget
from utils.training.config import TrainConfig
from utils.training.data import TrainData
from utils.training.ema import WeightAverage
from utils.training.run_folder import RunFolder
from utils.training.run_log import RunLog
from utils.training.sampler import BatchPlan, ResumableDistributedSampler
from utils.training.save_timer import SaveTimer
from utils.training.state import (
    TrainPosition,
    build_payload,
    dataset_record,
    enter_ranking,
    inference_of_run,
    weights_only_payload,
)
from utils.training.step import TrainStep
from utils.training.validation import ValidationStopped, Validator
from utils.wording import count

logger = logging.getLogger(__name__)


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

    @property
    def evaluated_model(self) -> nn.Module:
        """What validates: the average of the weights with --ema, else the unwrapped model."""
        return self.ema.module if self.ema is not None else self.raw_model


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
    """The loop over epochs and optimizer steps, reading its flags from ``config`` (the flat ``TrainConfig``).

    ``last_epoch``: the run's plan (a resumed run takes it from its checkpoint, ``setup.epoch_range``).
    """

    def __init__(
        self,
        config: TrainConfig,
        ctx: DistributedContext,
        parts: TrainParts,
        *,
        last_epoch: int,
        run_folder: RunFolder,
        run_log: RunLog,
        validator: Validator,
        interrupts: InterruptFlag,
    ) -> None:
        self.config = config
        self.ctx = ctx
        self.parts = parts
        self.step = parts.step
        self.last_epoch = last_epoch
        self.run_folder = run_folder
        self.run_log = run_log
        self.validator = validator
        self.position = parts.position
        self._stop = StopAgreement(ctx, interrupts)
        self._plan = parts.batch_plan
        self._last_saved_at: tuple[int, int] | None = None  # (global_step, epoch) of the state in last.pth
        # Read on global rank 0 only; the other ranks learn its decision through the stop agreement.
        self._save_timer = SaveTimer(config.checkpoint.save_every_minutes)

    # ---------------------------------------------------------------------------------------------------- public

    def train(self) -> TrainOutcome:
        outcome = None
        self.parts.raw_model.train()
        with self.run_log.start(self.position.global_step):
            if self.ctx.is_main:
                log_budget(self._checkpoint_budget())
            try:
                while outcome is None and self.position.epoch < self.last_epoch:
                    if self._max_steps_reached():
                        outcome = self._stop_for_max_steps()
                        break
                    outcome = self._run_epoch(self.position.epoch) or self._end_epoch(self.position.epoch)
            except DatasetError as error:
                # A file that failed to load, in training or validation. A worker's error carries the loader's
                # iterator in its traceback: dropping the traceback lets the iterator shut its workers down now; kept
                # alive with the error, its idle workers (which ignore SIGTERM, see utils.training.data) would block
                # the interpreter's exit forever.
                error.__traceback__ = None
                self._stop_for_bad_data(user_message(error))
        self._check_skipped_steps()
        self._stop.finish()
        if self.run_log.draw_curves():
            logger.info("Curves written to %s", self.run_folder.curves)
        # Nobody leaves before rank 0 has written its files: a launcher may kill the others' siblings on exit.
        barrier(self.ctx)
        return outcome or TrainOutcome(self.position)

    def _checkpoint_budget(self) -> CheckpointBudget:
        epoch_files = epoch_files_written(
            epochs_done=self.position.epoch,
            last_epoch=self.last_epoch,
            save_every=self.config.checkpoint.save_every,
            keep_last=self.config.checkpoint.keep_last,
        )
        return checkpoint_budget(
            self.parts.raw_model,
            self.step.optimizer,
            epoch_files=epoch_files,
            keep_best=self.config.checkpoint.keep_best,
        )

    def close(self) -> None:
        """Close metrics.jsonl, TensorBoard and the wandb run, and release the run folder's lock."""
        try:
            self.run_log.close()
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
        with self.run_log.epoch_bar(epoch, images_done=images_done):
            for offset, batch in enumerate(self._batches()):
                index = batches_done + offset
                group = plan.accumulation_group(index, batches_in_epoch)
                closes_group = group.closes_with(index)
                # A resume whose batch size or world size changed may start inside a group: it opens a step too.
                if group.opens_with(index) or offset == 0:
                    self.step.begin()
                self.run_log.trained(self.step.accumulate(batch, group.size, sync_gradients=closes_group))
                if not closes_group:
                    continue
                self.step.update()
                if self.parts.ema is not None:
                    self.parts.ema.update()
                self.position.global_step += 1
                self.position.step_in_epoch = index + 1
                outcome = self._after_step(epoch)
                if outcome is not None:
                    return outcome
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
        improved, place = False, None
        previous_ranking = self.position.best_ranking
        # Every rank reads the epoch's remaining losses here (a collective), whether or not it logs.
        self.run_log.add_losses(self.step.take_losses())
        if self._should_validate(epoch_number):
            try:
                dice = self.validator.validate(epoch_number, self.position.global_step)
            except ValidationStopped as stop:
                # Saved as "every batch trained, not validated": the resumed run repeats the validation.
                self.position.epoch, self.position.step_in_epoch = epoch, trained_steps
                return self._stop_for_signal(stop.signum)
            if self.config.optimisation.scheduler == "plateau":
                self.parts.scheduler.step(dice)
            self.position.validations_without_improvement = early_stop.validations_without_improvement(
                self.config.optimisation, dice, self.position.best_dice, self.position.validations_without_improvement
            )
            improved = dice > self.position.best_dice
            if improved:
                self.position.best_dice, self.position.best_epoch = dice, epoch_number
            if self.config.checkpoint.keep_best:
                ranking = [list(entry) for entry in previous_ranking]
                place = enter_ranking(ranking, dice, self.position.global_step, keep=self.config.checkpoint.keep_best)
                self.position.best_ranking = ranking
        self.run_log.epoch_line(epoch_number=epoch_number, global_step=self.position.global_step)
        targets = [self.run_folder.last]
        if self.config.checkpoint.save_every and epoch_number % self.config.checkpoint.save_every == 0:
            targets.append(self.run_folder.epoch_checkpoint(epoch_number))
        if improved:
            targets.append(self.run_folder.best)
        make_room = None
        if place is not None:
            targets.append(self.run_folder.ranked_best(place))
            make_room = functools.partial(self.run_folder.make_room_for_best, place, self.config.checkpoint.keep_best)
        if not self._save(targets, before_write=make_room):
            self.position.best_ranking = previous_ranking  # the files did not move
        if self.ctx.is_main and self.config.checkpoint.keep_last:
            for path in self.run_folder.prune_epoch_checkpoints(self.config.checkpoint.keep_last):
                logger.info("Removed %s (--keep-last %d)", path.name, self.config.checkpoint.keep_last)
        stale = self.position.validations_without_improvement
        if early_stop.should_stop(self.config.optimisation, stale) and epoch_number < self.last_epoch:
            reason = early_stop.reason(self.config.optimisation, self.position.best_dice, self.position.best_epoch)
            return TrainOutcome(self.position, checkpoint=self.run_folder.last, stopped_early=reason)
        return None

    def _should_validate(self, epoch_number: int) -> bool:
        return epoch_number % self.config.logging.val_every == 0 or epoch_number == self.last_epoch

    # ---------------------------------------------------------------------------------------------------- steps

    def _after_step(self, epoch: int) -> TrainOutcome | None:
        """Logging, step checkpoints, and the stop decisions due at this optimizer-step boundary."""
        step = self.position.global_step
        if step % self.config.logging.log_every == 0:
            # The only host synchronisation of the loop: one small all-reduce and read every --log-every steps.
            self.run_log.add_losses(self.step.take_losses())
            self._check_skipped_steps()
            self.run_log.log_train(epoch=epoch, position=self.position, lr=self.step.optimizer.param_groups[0]["lr"])
        if self.config.checkpoint.save_every_steps and step % self.config.checkpoint.save_every_steps == 0:
            self._save([self.run_folder.last])
        signum = self._stop.poll(save_due=self.ctx.is_main and self._save_timer.due())
        if self._stop.save_agreed and not signum and self._last_saved_at != (step, self.position.epoch):
            # Every rank got the same answer at this boundary, so all of them save here together.
            if not self._save([self.run_folder.last]):
                self._save_timer.saved()  # a skipped step postponed it: count the next interval from now
        if signum:
            return self._stop_for_signal(signum)
        if self._max_steps_reached():
            return self._stop_for_max_steps()
        return None

    def _max_steps_reached(self) -> bool:
        return (
            bool(self.config.optimisation.max_steps) and self.position.global_step >= self.config.optimisation.max_steps
        )

    # ---------------------------------------------------------------------------------------------------- stops

    def _stop_for_signal(self, signum: int) -> TrainOutcome:
        saved = self._save([self.run_folder.interrupted])
        return TrainOutcome(
            self.position, interrupted_by=signum, checkpoint=self.run_folder.interrupted if saved else None
        )

    def _stop_for_bad_data(self, message: str) -> NoReturn:
        """A file that failed to load mid-run, on any rank: every rank saves INTERRUPTED.pth together (nothing trained
        is lost: the state of the last whole optimizer step), then stops with the file's error."""
        where = self.run_folder.interrupted if self._save([self.run_folder.interrupted]) else None
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
        logger.info("Reached --max-steps %d", self.config.optimisation.max_steps)
        last = self.run_folder.last
        saved = self._last_saved_at == (self.position.global_step, self.position.epoch) or self._save([last])
        return TrainOutcome(self.position, reached_max_steps=True, checkpoint=last if saved else None)

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
        limit = self.config.optimisation.max_nonfinite_steps
        if limit and report.longest_run >= limit:
            diverged = UserError(
                f"training diverged: {report.longest_run} optimizer steps in a row (up to step {step}) had NaN or inf "
                f"loss or gradients and were skipped; the newest checkpoint in {self.run_folder} (if any) holds the "
                f"last good state. Lower --learning-rate, keep --grad-clip on, check the data, or raise "
                f"--max-nonfinite-steps (now {limit})"
            )
            raise raised_on_every_rank(diverged)  # every rank counts the same steps
        return report.current_run

    # --------------------------------------------------------------------------------------------- checkpoints

    def _save(self, targets: list[Path], *, before_write: Callable[[], None] | None = None) -> bool:
        """Write the current state to ``targets`` in the run folder (global rank 0); False when it is not saved.

        Called on every rank. A state is saved only when healthy: a skipped latest step postpones the save (the
        previous files stay), non-finite weights stop the run. A failed write (disk full, no permission) stops every
        rank with rank 0's message instead of leaving the others to find it gone.
        """
        if self._check_skipped_steps():
            if self.ctx.is_main:
                logger.warning(
                    "Not saving %s at step %d: the latest optimizer step had NaN or inf gradients and was skipped; "
                    "the previous checkpoint stays",
                    ", ".join(path.name for path in targets),
                    self.position.global_step,
                )
            return False
        if not all_finite(list(self.parts.raw_model.state_dict().values())):
            # DDP keeps weights and buffers identical on every rank: all of them stop here with this message.
            raise raised_on_every_rank(
                UserError(
                    f"the weights became NaN or inf by step {self.position.global_step} although the gradients were "
                    f"finite, so the learning rate is far too large; nothing was saved (the newest checkpoint in "
                    f"{self.run_folder}, if any, holds the last good state). Lower --learning-rate"
                )
            )
        agree_on_errors(self.ctx, lambda: self._write_checkpoint(targets, before_write) if self.ctx.is_main else None)
        if self.run_folder.last in targets:
            self._last_saved_at = (self.position.global_step, self.position.epoch)
            self._save_timer.saved()
        return True

    def checkpoint_payload(self) -> dict[str, Any]:
        """The checkpoint of the current state, as ``_write_checkpoint`` saves it (the benchmark times the same)."""
        parts = self.parts
        return build_payload(
            model=parts.raw_model,
            model_args=parts.model_args,
            mask_values=parts.data.mask_values,
            inference=inference_of_run(parts.run_args, parts.data.n_channels),
            optimizer=self.step.optimizer,
            scheduler=parts.scheduler,
            scaler=self.step.scaler,
            position=self.position,
            args=parts.run_args,
            world_size=self.ctx.world_size,
            dataset=dataset_record(parts.data.train_dataset.ids),
            split_digest=parts.data.split.digest if parts.data.split is not None else None,
            ema=parts.ema.state_dict() if parts.ema is not None else None,
        )

    def _write_checkpoint(self, targets: list[Path], before_write: Callable[[], None] | None = None) -> None:
        if before_write is not None:
            before_write()
        with self.run_log.phase("checkpoint"):
            payload = self.checkpoint_payload()
            # best.pth and best-K.pth are for sharing and inference: the weights only (utils.training.run_folder).
            shared = [path for path in targets if self.run_folder.is_weights_only(path)]
            _write_copies(payload, [path for path in targets if path not in shared])
            _write_copies(weights_only_payload(payload), shared)
        logger.info(
            "Saved %s at step %d (%s and %s done)",
            ", ".join(path.name for path in targets),
            self.position.global_step,
            count(self.position.epoch, "epoch"),
            count(self.position.step_in_epoch, "batch", "batches"),
        )


def _write_copies(payload: dict[str, Any], targets: list[Path]) -> None:
    """Serialise ``payload`` once, to the first target; the others get copies of its bytes, each a file of its own."""
    if not targets:
        return
    save_checkpoint_atomic(payload, targets[0])
    for target in targets[1:]:
        copy_checkpoint_atomic(targets[0], target)


def _next_batch(iterator: Iterator[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
    """The next batch (None at the end); a load failure as a DatasetError holding just its message.

    The message is what the other ranks receive, so a DataLoader worker's traceback text is cut off here; and the new
    error holds no traceback through the loader's iterator (see ``Trainer.train``).
    """
    try:
        return next(iterator, None)
    except DatasetError as error:
        error.__traceback__ = None
        message = user_message(error)
    raise DatasetError(message)
