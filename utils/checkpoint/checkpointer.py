"""``Checkpointer``: the one owner of when a run saves, which files it writes, their pruning, and the restore.

The loop tells it where it stands (``save_if_due`` after every optimizer step, ``save_timed`` when the ranks agreed
on a --save-every-minutes save, ``save_epoch`` at an epoch's end, ``save_now`` when the run stops) and it decides:

* ``last.pth``: every epoch end, every ``--save-every-steps`` optimizer steps, every ``--save-every-minutes`` and when
  ``--max-steps`` stops the run (not again when it holds that very step already);
* ``checkpoint_epoch{N}.pth``: every ``--save_every`` epochs, the newest ``--keep-last`` kept;
* ``best.pth`` (weights only) when the validation Dice improved, and ``best-1.pth`` .. ``best-K.pth`` (``--keep-best``)
  ranked by Dice; the ranking is part of the run's position, so a resumed run ranks on where it stopped;
* ``INTERRUPTED.pth`` when a signal or a file that failed to load stops the run.

Only global rank 0 writes, and only a healthy state: a skipped latest step postpones the save (the previous files
stay), non-finite weights stop the run. Every call is made on every rank at the same boundary, so the ranks agree on
a failed write (disk full, no permission) instead of leaving the others to find rank 0 gone.

A resume is one ``restore`` of every part that has ``state_dict()``/``load_state_dict()``, as torchtitan's
``CheckpointManager`` does.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from utils.checkpoint.files import save_checkpoint_atomic
from utils.checkpoint.format import (
    KEY_ARGS,
    KEY_MODEL_ARGS,
    WEIGHTS_ONLY_KEYS,
    InferenceRecord,
    LoadedWeights,
    TrainingState,
    all_finite,
    dataset_record,
    restore_rng_state,
)
from utils.errors import UserError, count
from utils.launch.process_group import DistributedContext, agree_on_errors, raised_on_every_rank

if TYPE_CHECKING:
    from utils.training.config import CheckpointSection
    from utils.training.parts import TrainParts

logger = logging.getLogger(__name__)


def monotonic() -> float:
    """The clock of every timer, looked up at each reading (tests replace it to let minutes pass in milliseconds)."""
    return time.monotonic()


def is_due(every: int, count: int) -> bool:
    """Whether step or epoch number ``count`` is one of every ``every`` (``--save-every-steps``, ``--save_every``;
    0: never)."""
    return every > 0 and count % every == 0


class Checkpointer:
    """When and which checkpoint files a run writes (see the module docstring), from the checkpoint flags.

    ``parts`` is what a save reads of the run (the checkpoint section of its flags, its folder and position, the
    unwrapped model and its arguments, the optimizer step, the scheduler, the average, the data and the flags);
    ``skipped_steps`` reports the run of skipped optimizer steps up to now (0: the latest was applied), ``phase``
    times a write (``RunLog.phase``).
    """

    def __init__(
        self,
        ctx: DistributedContext,
        parts: TrainParts,
        *,
        skipped_steps: Callable[[], int],
        phase: Callable[[str], AbstractContextManager[None]],
    ) -> None:
        self.config = parts.config.checkpoint
        self.ctx = ctx
        self.folder = parts.run_folder
        self.parts = parts
        self.position = parts.position
        self._skipped_steps = skipped_steps
        self._phase = phase
        # --save-every-minutes (Lightning's train_time_interval): rank 0's clock says a save is due once an interval
        # passed since the last save; the other ranks learn it on the stop agreement's all-reduce
        # (utils.launch.process_group.StopAgreement), so every rank saves at the same step.
        self._interval_start = monotonic()
        self._timed_save_asked = False
        self._last_saved_at: tuple[int, int] | None = None  # (global_step, epoch) of the state in last.pth
        # What every file records of the run besides its state, fixed when the run starts: the weights' record (how
        # images were prepared, --scale, --ignore-value, channels, and --class-names: read from the flags once, by the
        # reader of files that predate the record, so a reader of the file never depends on what a flag is called).
        data = parts.data
        inference = InferenceRecord.of({KEY_ARGS: parts.run_args, KEY_MODEL_ARGS: {"n_channels": data.n_channels}})
        split_digest = data.split.digest if data.split is not None else None
        self._record = LoadedWeights({}, parts.model_args, data.mask_values, inference, split_digest)
        self._dataset = dataset_record(data.train_dataset.ids)

    # ------------------------------------------------------------------------------------------------ when

    def save_if_due(self) -> None:
        """At an optimizer-step boundary: ``last.pth`` every ``--save-every-steps`` steps."""
        if is_due(self.config.save_every_steps, self.position.global_step):
            self._save([self.folder.last])

    def timed_save_due(self) -> bool:
        """Whether this process asks for a --save-every-minutes save: global rank 0 (the others never ask), once the
        interval passed since the last save, then not again until a save starts the next interval (0 minutes: never)."""
        interval_s = self.config.save_every_minutes * 60
        if not self.ctx.is_main or not interval_s or self._timed_save_asked:
            return False
        self._timed_save_asked = monotonic() - self._interval_start >= interval_s
        return self._timed_save_asked

    def save_timed(self) -> None:
        """The save every rank agreed on at this boundary (``timed_save_due`` of some rank), unless already done."""
        if not self._save_last():
            self._start_interval()  # a skipped step postponed it: count the next interval from now

    def _start_interval(self) -> None:
        self._interval_start = monotonic()
        self._timed_save_asked = False

    def save_epoch(self, epoch_number: int, dice: float | None, *, improved: bool) -> None:
        """At the end of epoch ``epoch_number`` (``dice``: its validation score, None when it did not validate)."""
        targets = [self.folder.last]
        if is_due(self.config.save_every, epoch_number):
            targets.append(self.folder.epoch_checkpoint(epoch_number))
        # best.pth and best-K.pth are for sharing and inference: the weights only (utils.checkpoint.run_folder).
        shared = [self.folder.best] if improved else []
        previous = self.position.best_ranking
        place = self.position.rank(dice, self.config.keep_best) if dice is not None else None
        if place is not None:
            shared.append(self.folder.ranked_best(place))
        if not self._save(targets, shared, best_place=place):
            self.position.best_ranking = previous  # the files did not move
        if self.ctx.is_main:  # --keep-last 0 (keep all) prunes nothing
            for path in self.folder.prune_epoch_checkpoints(self.config.keep_last):
                logger.info("Removed %s (--keep-last %d)", path.name, self.config.keep_last)

    def save_now(self, reason: str) -> Path | None:
        """The final state of a stopped run: ``"interrupted"`` (INTERRUPTED.pth) or ``"last"`` (--max-steps, not
        written again when last.pth holds this step); the file, None when it could not be saved."""
        if reason == "last":
            return self.folder.last if self._save_last() else None
        return self.folder.interrupted if self._save([self.folder.interrupted]) else None

    def _save_last(self) -> bool:
        """``last.pth``, unless it holds this very step already; False when the state is not saved."""
        return self._last_saved_at == (self.position.global_step, self.position.epoch) or self._save([self.folder.last])

    # ------------------------------------------------------------------------------------------------ which

    def _save(self, full: list[Path], shared: Sequence[Path] = (), *, best_place: int | None = None) -> bool:
        """Write the current state to ``full`` and its weights alone to ``shared`` (global rank 0) if it is healthy;
        False when it is not saved."""
        targets = [*full, *shared]
        if self._skipped_steps():  # logged once: ranks other than 0 log errors only
            logger.warning(
                "Not saving %s at step %d: the latest optimizer step had NaN or inf gradients and was skipped; the "
                "previous checkpoint stays",
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
                    f"{self.folder}, if any, holds the last good state). Lower --learning-rate"
                )
            )
        agree_on_errors(self.ctx, lambda: self._write(full, shared, best_place) if self.ctx.is_main else None)
        if self.folder.last in targets:
            self._last_saved_at = (self.position.global_step, self.position.epoch)
            self._start_interval()
        return True

    def payload(self) -> dict[str, Any]:
        """The checkpoint of the current state, as every save writes it (the benchmark times the same)."""
        parts, scaler = self.parts, self.parts.step.scaler
        return TrainingState(
            weights=dataclasses.replace(self._record, state_dict=parts.raw_model.state_dict()),
            optimizer=parts.step.optimizer.state_dict(),
            scheduler=parts.scheduler.state_dict(),
            scaler=scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
            position=self.position,
            run_args=parts.run_args,
            world_size=self.ctx.world_size,
            dataset=self._dataset,
            ema=parts.ema.state_dict() if parts.ema is not None else None,
        ).to_payload()

    def _write(self, full: list[Path], shared: Sequence[Path], best_place: int | None) -> None:
        if best_place is not None:
            self.folder.make_room_for_best(best_place, self.config.keep_best)
        with self._phase("checkpoint"):
            payload = self.payload()
            save_checkpoint_atomic(payload, *full)
            if shared:
                save_checkpoint_atomic({key: payload[key] for key in WEIGHTS_ONLY_KEYS}, *shared)
        logger.info(
            "Saved %s at step %d (%s and %s done)",
            ", ".join(path.name for path in [*full, *shared]),
            self.position.global_step,
            count(self.position.epoch, "epoch"),
            count(self.position.step_in_epoch, "batch", "batches"),
        )

    # ------------------------------------------------------------------------------------------------ size

    def log_budget(self) -> None:
        """One line before training (rank 0's: the others log errors only): how much disk the files of this run take
        at most, so a full disk is foreseen."""
        epochs = range(self.position.epoch + 1, self.parts.config.epoch_range()[1] + 1)  # the epochs it trains
        logger.info(budget_line(self.parts.raw_model, self.parts.step.optimizer, self.config, epochs))


def restore(state: TrainingState, parts: Mapping[str, Any]) -> None:
    """Load a resumed ``state`` into every part that has it: ``model``, ``optimizer``, ``scheduler``, ``scaler`` and
    ``ema`` (None where the run has none), and the RNG. The run goes on from ``state.position`` itself.

    ``state`` was checked against the model already (``utils.training.model.check_resume``). The optimizer is
    restored before the average, whose reference step count is the optimizer's.
    """
    parts["model"].load_state_dict(state.weights.state_dict)
    for name in ("optimizer", "scheduler", "scaler"):  # a scaler's state only where the run and the file have one
        if parts[name] is not None and getattr(state, name):
            parts[name].load_state_dict(getattr(state, name))
    ema = parts["ema"]
    if ema is None and state.ema is not None:
        logger.warning("the resumed checkpoint holds an average of the weights, but without --ema it is dropped")
    elif ema is not None:
        if state.ema is None:
            logger.info(
                "--ema %g: the resumed checkpoint has no average of the weights; it starts from them now", ema.decay
            )
        # A resume that switches --ema on starts the average from the resumed weights.
        ema.load_state_dict(state.ema if state.ema is not None else state.weights.state_dict)
    if state.rng_state is not None:
        restore_rng_state(state.rng_state)


def budget_line(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: CheckpointSection, epochs: range
) -> str:
    """The files a run that trains ``epochs`` keeps at most under the checkpoint flags ``config``, and their sizes.

    Full-state files (last.pth, INTERRUPTED.pth, the kept epoch files) hold the weights plus the optimizer's
    per-parameter state; best.pth and best-K.pth the weights only. Estimated from the tensors (the optimizer's state
    does not exist before the first step); pickling adds a few kB.
    """
    weights = sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values())
    parameters = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    # Tensors of a parameter's size kept per parameter: AdamW's two averages; RMSprop's one, and its momentum buffer.
    slots = 1 + int(optimizer.defaults["momentum"] > 0) if isinstance(optimizer, torch.optim.RMSprop) else 2
    full_state = weights + parameters * slots
    epoch_files = sum(1 for number in epochs if is_due(config.save_every, number))
    full_files = 2 + (min(epoch_files, config.keep_last) if config.keep_last else epoch_files)
    weights_files = 1 + config.keep_best
    total = full_state * full_files + weights * weights_files
    return (
        f"Checkpoints: a full-state file (last.pth, INTERRUPTED.pth, checkpoint_epoch{{N}}.pth) is about "
        f"{full_state / 1e6:.1f} MB, best.pth (weights only) about {weights / 1e6:.1f} MB; this run keeps at most "
        f"{full_files} full-state and {weights_files} weights-only files, about {total / 1e6:.1f} MB"
    )
