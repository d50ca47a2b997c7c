"""The training loop: ``Trainer.train()`` runs epochs of optimizer steps and returns how the run ended.

The loop calls its components: the optimizer step (``utils.training.step``), the validation
(``utils.training.validation``), the run's log (``utils.training.run_log``) and the checkpoint writes. Per optimizer
step it does no host synchronisation: losses and the count of steps skipped for non-finite gradients
(``utils.training.nonfinite``) accumulate on the device and are read every ``--log-every`` steps and at checkpoints,
and the ranks' stop decision travels on an asynchronous CPU all-reduce (``StopAgreement``). The one wait
between ranks it adds is on the CPU: before computing on a batch, the ranks agree that each of them loaded its own
(``Trainer._batches``; about 85 us per batch with 2 local processes).
The loop tells its ``Checkpointer`` (``utils.checkpoint.checkpointer``) where it stands at every step and epoch
boundary; what to save, when, and whether the state is healthy enough to be saved is decided there.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from utils.checkpoint.checkpointer import Checkpointer
from utils.checkpoint.format import TrainPosition
from utils.checkpoint.run_folder import RunFolder
from utils.errors import DatasetError, UserError, user_message
from utils.launch.process_group import DistributedContext, StopAgreement, agree_on_errors, barrier, raised_on_every_rank
from utils.launch.signals import InterruptFlag
from utils.training import early_stop
from utils.training.config import TrainConfig
from utils.training.data import Loaders, TrainData
from utils.training.ema import WeightAverage
from utils.training.run_log import RunLog
from utils.training.sampler import BatchPlan
from utils.training.step import TrainStep
from utils.training.validation import ValidationStopped, Validator

logger = logging.getLogger(__name__)


@dataclass
class TrainParts:
    """Everything the loop works on, built (and restored from a checkpoint) by ``utils.training.setup``."""

    raw_model: nn.Module
    """The plain UNet: evaluated, and saved in checkpoints."""
    step: TrainStep
    """The optimizer step; it holds the model as the forward pass calls it (DDP and/or compiled)."""
    scheduler: Any
    data: TrainData
    loaders: Loaders
    """This rank's sampler, training loader and validation loader (if it validates)."""
    batch_plan: BatchPlan
    model_args: dict[str, Any]
    config: TrainConfig
    """The run's flags (a resumed run's with its checkpoint's epoch plan)."""
    run_folder: RunFolder
    """Where the run's files go (locked on global rank 0, which chose it)."""
    position: TrainPosition
    """Where the run stands: the loop moves it on; the log, the validation and the checkpoints read it."""
    resume_images_in_epoch: int
    """Global images of epoch ``position.epoch`` already trained by the run this one resumes."""
    ema: WeightAverage | None = None
    """--ema: the average of the weights, updated after every applied step; it validates and is saved as the model."""
    resumed: bool = False
    """Whether ``position`` is a resumed checkpoint's (TensorBoard's step axis goes on from it)."""

    @property
    def run_args(self) -> dict[str, Any]:
        """The run's flags as a plain dict, stored in every checkpoint."""
        return self.config.as_dict()

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
    """The loop over epochs and optimizer steps, reading its flags from ``parts.config``, the run's (a resumed run's
    epoch plan is its checkpoint's: ``setup.planned_config``)."""

    def __init__(
        self,
        ctx: DistributedContext,
        parts: TrainParts,
        *,
        run_log: RunLog,
        validator: Validator,
        interrupts: InterruptFlag,
    ) -> None:
        self.config = config = parts.config
        self.ctx = ctx
        self.parts = parts
        self.step = parts.step
        self.last_epoch = config.epoch_range()[1]
        self.run_log = run_log
        self.validator = validator
        self.position = parts.position
        self._stop = StopAgreement(ctx, interrupts)
        self.checkpointer = Checkpointer(ctx, parts, skipped_steps=self._check_skipped_steps, phase=run_log.phase)

    # ---------------------------------------------------------------------------------------------------- public

    def train(self) -> TrainOutcome:
        outcome = None
        self.parts.raw_model.train()
        with self.run_log.start():
            self.checkpointer.log_budget()
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
            logger.info("Curves written to %s", self.parts.run_folder.curves)
        # Nobody leaves before rank 0 has written its files: a launcher may kill the others' siblings on exit.
        barrier(self.ctx)
        return outcome or TrainOutcome(self.position)

    def close(self) -> None:
        """Close metrics.jsonl, TensorBoard and the wandb run, and release the run folder's lock."""
        try:
            self.run_log.close()
        finally:
            self.parts.run_folder.unlock()

    # --------------------------------------------------------------------------------------------------- epochs

    def _run_epoch(self, epoch: int) -> TrainOutcome | None:
        """Train the remaining batches of ``epoch``; an outcome when the run must stop before the epoch's end."""
        plan = self.parts.batch_plan
        # Global images of the epoch trained before this process started (only the resumed epoch has any).
        images_done, self.parts.resume_images_in_epoch = self.parts.resume_images_in_epoch, 0
        self.parts.loaders.sampler.set_epoch(epoch, consumed=images_done)
        self.parts.data.train_dataset.set_epoch(epoch)
        self.step.set_epoch(epoch)  # --freeze-encoder-epochs
        batches_done = plan.batches_done(images_done)
        batches_in_epoch = plan.batches_in_epoch(images_done)
        with self.run_log.epoch_bar(epoch, images_done=images_done):
            for offset, batch in enumerate(self._batches()):
                index = batches_done + offset
                group = plan.accumulation_group(index, batches_in_epoch)
                closes_group = index == group[-1]
                # A resume whose batch size or world size changed may start inside a group: it opens a step too.
                if index == group.start or offset == 0:
                    self.step.begin()
                self.run_log.trained(self.step.accumulate(batch, len(group), sync_gradients=closes_group))
                if not closes_group:
                    continue
                self.step.update()
                if self.parts.ema is not None:
                    self.parts.ema.update()
                self.position.global_step += 1
                self.position.step_in_epoch = index + 1
                outcome = self._after_step()
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
        iterator = iter(self.parts.loaders.train)
        while True:
            batch = agree_on_errors(self.ctx, functools.partial(_next_batch, iterator))
            if batch is None:
                return
            yield batch

    def _end_epoch(self, epoch: int) -> TrainOutcome | None:
        """Validate, save, and stop early (--patience) when the validations stopped improving."""
        epoch_number = epoch + 1
        trained_steps = self.position.step_in_epoch  # kept for a stop during validation
        self.position.epoch = epoch_number
        self.position.step_in_epoch = 0
        improved, dice = False, None
        # Every rank reads the epoch's remaining losses here (a collective), whether or not it logs.
        self.run_log.add_losses(self.step.take_losses())
        if self._should_validate(epoch_number):
            try:
                dice = self.validator.validate()
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
        self.run_log.epoch_line()
        self.checkpointer.save_epoch(epoch_number, dice, improved=improved)
        stale = self.position.validations_without_improvement
        if early_stop.should_stop(self.config.optimisation, stale) and epoch_number < self.last_epoch:
            reason = early_stop.reason(self.config.optimisation, self.position.best_dice, self.position.best_epoch)
            return TrainOutcome(self.position, checkpoint=self.parts.run_folder.last, stopped_early=reason)
        return None

    def _should_validate(self, epoch_number: int) -> bool:
        return epoch_number % self.config.logging.val_every == 0 or epoch_number == self.last_epoch

    # ---------------------------------------------------------------------------------------------------- steps

    def _after_step(self) -> TrainOutcome | None:
        """Logging, step checkpoints, and the stop decisions due at this optimizer-step boundary."""
        if self.position.global_step % self.config.logging.log_every == 0:
            # The only host synchronisation of the loop: one small all-reduce and read every --log-every steps.
            self.run_log.add_losses(self.step.take_losses())
            self._check_skipped_steps()
            self.run_log.log_train()
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
        return (
            bool(self.config.optimisation.max_steps) and self.position.global_step >= self.config.optimisation.max_steps
        )

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
            else f"the newest checkpoint in {self.parts.run_folder} holds the last saved state"
        )
        error = DatasetError(
            f"{message}; {kept}: continue with --resume auto once the file is fixed (a removed file changes the "
            f"dataset, which a resume refuses: then start from that checkpoint with --load)"
        )
        raise raised_on_every_rank(error)

    def _stop_for_max_steps(self) -> TrainOutcome:
        logger.info("Reached --max-steps %d", self.config.optimisation.max_steps)
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
        limit = self.config.optimisation.max_nonfinite_steps
        if limit and report.longest_run >= limit:
            diverged = UserError(
                f"training diverged: {report.longest_run} optimizer steps in a row (up to step {step}) had NaN or inf "
                f"loss or gradients and were skipped; the newest checkpoint in {self.parts.run_folder} (if any) holds "
                f"the last good state. Lower --learning-rate, keep --grad-clip on, check the data, or raise "
                f"--max-nonfinite-steps (now {limit})"
            )
            raise raised_on_every_rank(diverged)  # every rank counts the same steps
        return report.current_run


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
