"""The training loop: ``Trainer.train()`` runs epochs of optimizer steps and returns how the run ended.

The loop calls its components: the optimizer step (``utils.training.step``), the validation (``Validator``, below),
the run's log (``utils.training.run_log``) and the checkpoint writes. Per optimizer step it does no host
synchronisation: losses and the count of steps skipped for non-finite gradients (``utils.training.step``) accumulate
on the device and are read every ``--log-every`` steps and at checkpoints, and the ranks' stop decision travels on an
asynchronous CPU all-reduce (``StopAgreement``). The one wait between ranks it adds is on the CPU: before computing on
a batch, the ranks agree that each of them loaded its own (``Trainer._batches``; about 85 us per batch with 2 local
processes).
The loop tells its ``Checkpointer`` (``utils.checkpoint.checkpointer``) where it stands at every step and epoch
boundary; what to save, when, and whether the state is healthy enough to be saved is decided there.

``Validator``: the validation Dice that every rank steps on, and its report on global rank 0.

Every rank scores its part of the validation set with the unwrapped model, and the sums are all-reduced, so every rank
gets the scores of the whole set (ReduceLROnPlateau must step identically everywhere). ``--val-mode rank0`` (the
default): rank 0's part is the whole set and the others have none: they wait in the all-reduce while rank 0 scores.
``--val-mode sharded``: every rank scores its own part (``utils.evaluation.shard_range``). Either way a file that
fails to load stops every rank with its message.

A stop signal during a rank-0 validation ends it at the next batch, so that the trained state is saved at once, not
after it: with a short grace period (SLURM's, Kubernetes') a validation that runs to its end, followed by one more
training batch, can lose the whole trained epoch. Rank 0 scores batches only while no signal has arrived
(``UntilStopped``); when one arrives, the partial score is dropped, every rank learns the signal from a second
all-reduce, and the loop saves ``INTERRUPTED.pth`` with the position of the epoch's last step (every batch trained,
the validation not done). The resumed run has no batch of that epoch left, so it goes straight to the epoch's end and
repeats the validation.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from utils.checkpoint.checkpointer import Checkpointer
from utils.errors import DatasetError, count, user_message
from utils.evaluation import score_batches
from utils.launch.process_group import (
    DistributedContext,
    StopAgreement,
    agree_on_errors,
    barrier,
    raised_on_every_rank,
    sum_across_ranks,
)
from utils.launch.signals import InterruptFlag
from utils.training.parts import TrainParts
from utils.training.run_log import RunLog

logger = logging.getLogger(__name__)


@dataclass
class TrainOutcome:
    """How ``train()`` ended: its last line (completed, stopped by --max-steps or --patience, or interrupted by a
    signal, then with the checkpoint it saved and how to go on), and the signal."""

    line: str
    interrupted_by: int = 0


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


class Trainer:
    """The loop over epochs and optimizer steps, reading its flags from ``parts.config``, the run's (a resumed run's
    epoch plan is its checkpoint's: ``setup.check_resume_flags``). It opens the run's ``RunLog`` (which may refuse the
    run folder: a ConfigError) and its ``Validator`` and ``Checkpointer``."""

    def __init__(self, ctx: DistributedContext, parts: TrainParts, interrupts: InterruptFlag) -> None:
        self.config = parts.config
        self.ctx = ctx
        self.parts = parts
        self.step = parts.step
        self.last_epoch = parts.config.epoch_range()[1]
        self.position = parts.position
        self.run_log = RunLog(ctx, parts)
        self.validator = Validator(ctx, parts, interrupts=interrupts, run_log=self.run_log)
        self._stop = StopAgreement(ctx, interrupts)
        self.checkpointer = Checkpointer(ctx, parts, skipped_steps=self._skipped_steps, phase=self.run_log.phase)

    # ---------------------------------------------------------------------------------------------------- public

    def train(self) -> TrainOutcome:
        outcome = None
        self.parts.raw_model.train()
        with self.run_log.start():
            self.checkpointer.log_budget()
            try:
                while outcome is None and self.position.epoch < self.last_epoch:
                    epoch = self.position.epoch
                    outcome = self._stop_at_max_steps() or self._run_epoch(epoch) or self._end_epoch(epoch)
            except DatasetError as error:
                # A file that failed to load, in training or validation. The loaders' workers are down already: on
                # the rank whose file failed, utils.hardware.SharedMemoryGuard shut them; on the others, the epoch
                # closed its loader on the way out (_batches).
                # Every rank saves INTERRUPTED.pth together (nothing trained is lost: the state of the last whole
                # optimizer step), then stops with the file's error.
                kept = f"the newest checkpoint in {self.parts.run_folder} holds the last saved state"
                if saved := self.checkpointer.save_now("interrupted"):
                    kept = f"saved {saved} (step {self.position.global_step})"
                bad_data = DatasetError(
                    f"{user_message(error)}; {kept}: continue with --resume auto once the file is fixed (a removed "
                    f"file changes the dataset, which a resume refuses: then start from that checkpoint with --load)"
                )
                raise raised_on_every_rank(bad_data) from None
        self._skipped_steps()
        self._stop.finish()
        if self.run_log.draw_curves():
            logger.info("Curves written to %s", self.parts.run_folder.curves)
        # Nobody leaves before rank 0 has written its files: a launcher may kill the others' siblings on exit.
        barrier(self.ctx)
        position = self.position
        complete = f"Training complete ({position.global_step} steps); best validation Dice {position.best_dice:.4f}"
        return outcome or TrainOutcome(complete)

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
        self.parts.loaders.train.sampler.set_epoch(epoch, consumed=images_done)
        self.parts.data.train_dataset.set_epoch(epoch)
        self.step.set_epoch(epoch)  # --freeze-encoder-epochs
        batches_done = plan.batches_done(images_done)
        batches_in_epoch = plan.batches_in_epoch(images_done)
        with self.run_log.epoch_bar(epoch, images_done=images_done):
            for index, batch in enumerate(self._batches(), start=batches_done):
                group = plan.accumulation_group(index, batches_in_epoch)
                closes_group = index == group[-1]
                # A resume whose batch size or world size changed may start inside a group: it opens a step too.
                if index == group.start or index == batches_done:
                    self.step.begin()
                self.run_log.trained(self.step.accumulate(batch, len(group), sync_gradients=closes_group))
                if not closes_group:
                    continue
                self.step.update()
                self.position.global_step += 1
                self.position.step_in_epoch = index + 1
                if outcome := self._after_step():
                    return outcome
        return None

    def _batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """The epoch's batches of this rank; a file that fails to load on any rank raises its error on every rank.

        With several processes a rank whose batch failed cannot join the gradient all-reduce the others wait in, so
        the ranks agree on every fetch before any of them computes on it (one integer all-reduce on the CPU control
        group per batch, next to a forward and backward pass). Every sampler gives every rank the same number of
        batches, so all of them reach the end of the epoch together. The loader's iterator is closed on the way out:
        left to an error's traceback, it would keep the workers up until the cyclic garbage collector, whose shutdown
        of them waits 5 s per worker.
        """
        with contextlib.closing(iter(self.parts.loaders.train)) as iterator:
            while (batch := agree_on_errors(self.ctx, lambda: _next_batch(iterator))) is not None:
                yield batch

    def _end_epoch(self, epoch: int) -> TrainOutcome | None:
        """Validate, save, and stop early when --patience validations in a row did not improve the validation Dice by
        more than --min-delta.

        The count travels in every checkpoint (``TrainPosition.validations_without_improvement``), so a resumed run
        stops where the uninterrupted one would have; every rank receives the same Dice, so every rank reaches the
        same decision without talking to the others.
        """
        epoch_number = epoch + 1
        trained_steps = self.position.step_in_epoch  # kept for a stop during validation
        position, flags = self.position, self.config.optimisation
        position.epoch, position.step_in_epoch = epoch_number, 0
        improved, dice = False, None
        if epoch_number % self.config.logging.val_every == 0 or epoch_number == self.last_epoch:
            dice, stopped = self.validator.validate()
            if stopped:
                # Saved as "every batch trained, not validated": the resumed run repeats the validation.
                position.epoch, position.step_in_epoch = epoch, trained_steps
                return self._stop_for_signal(stopped)
            if flags.scheduler == "plateau":
                self.step.scheduler.step(dice)
            enough = dice > position.best_dice + flags.min_delta
            position.validations_without_improvement = 0 if enough else position.validations_without_improvement + 1
            improved = dice > position.best_dice
            if improved:
                position.best_dice, position.best_epoch = dice, epoch_number
        # Every rank reads the epoch's remaining losses here (a collective), whether or not it logs.
        self.run_log.epoch_line()
        self.checkpointer.save_epoch(epoch_number, dice, improved=improved)
        if 0 < flags.patience <= position.validations_without_improvement and epoch_number < self.last_epoch:
            return TrainOutcome(
                f"Stopped at epoch {epoch_number}, step {position.global_step}; early stopping: no improvement of "
                f"validation Dice above {flags.min_delta:g} in {count(flags.patience, 'validation')}; best "
                f"{position.best_dice:.4f} at epoch {position.best_epoch}"
            )
        return None

    # ---------------------------------------------------------------------------------------------------- steps

    def _after_step(self) -> TrainOutcome | None:
        """Logging, step checkpoints, and the stop decisions due at this optimizer-step boundary."""
        if self.position.global_step % self.config.logging.log_every == 0:
            # The only host synchronisation of the loop: one small all-reduce and read every --log-every steps.
            self._skipped_steps()
            self.run_log.log_train()
        self.checkpointer.save_if_due()
        signum = self._stop.poll(save_due=self.checkpointer.timed_save_due())
        if self._stop.save_agreed and not signum:
            # Every rank got the same answer at this boundary, so all of them save here together.
            self.checkpointer.save_timed()
        if signum:
            return self._stop_for_signal(signum)
        return self._stop_at_max_steps()

    def _skipped_steps(self) -> int:
        """``TrainStep.skipped_steps`` at the position (the Checkpointer asks it before a save)."""
        return self.step.skipped_steps(self.position.global_step, self.parts.run_folder)

    # ---------------------------------------------------------------------------------------------------- stops

    def _stop_at_max_steps(self) -> TrainOutcome | None:
        max_steps = self.config.optimisation.max_steps
        if not max_steps or self.position.global_step < max_steps:
            return None
        logger.info("Reached --max-steps %d", max_steps)
        saved = self.checkpointer.save_now("last") or "the newest checkpoint of the run folder"
        return TrainOutcome(
            f"Stopped after --max-steps {max_steps}; {saved} holds the state (continue with --resume auto and a larger "
            f"--max-steps)"
        )

    def _stop_for_signal(self, signum: int) -> TrainOutcome:
        how = (
            ", without saving (the latest step was skipped for NaN/inf gradients). To continue from the newest "
            "checkpoint, run the same command with --resume auto"
        )
        if saved := self.checkpointer.save_now("interrupted"):
            how = f"; saved {saved}. To continue, run the same command with --resume auto (or --resume {saved})"
        where = f"at epoch {self.position.epoch + 1}, step {self.position.global_step}"
        return TrainOutcome(f"Stopped by {signal.Signals(signum).name} {where}{how}", interrupted_by=signum)


def _next_batch(iterator: Iterator[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
    """The next batch (None at the end); a load failure as a DatasetError holding just its message.

    The message is what the other ranks receive, so a DataLoader worker's traceback text is cut off here.
    """
    try:
        return next(iterator, None)
    except DatasetError as error:
        message = user_message(error)
    raise DatasetError(message)
