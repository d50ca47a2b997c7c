"""``Trainer``'s rules with a fake step: accumulation groups, save points and the stop agreement, without whole runs.

The Trainer runs for real (a real sampler and DataLoader, a real run folder and run log, real checkpoint files); only
the optimizer step is a ``RecordingStep`` that writes down what the loop asks of it, and the validator a
``ScriptedValidator`` that returns hand-picked Dice scores (the real ``Validator`` is tested at the end). Each expected
value below follows from the rules by hand (7 batches with --grad-accum 3 make steps of 3, 3 and 1 batches).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader

from tests.helpers import CPU_CONTEXT
from utils.checkpoint import checkpointer
from utils.checkpoint.format import TrainPosition
from utils.checkpoint.run_folder import RunFolder
from utils.evaluation import EvalResult
from utils.hardware import SharedMemoryGuard
from utils.launch.signals import InterruptFlag
from utils.training.config import parse_config
from utils.training.curves import read_series
from utils.training.data import Loaders, TrainData
from utils.training.loop import Trainer, Validator
from utils.training.parts import TrainParts
from utils.training.run_log import RunLog
from utils.training.sampler import BatchPlan, ResumableDistributedSampler


class RecordingStep:
    """Stands in for ``TrainStep``: records every call; ``on_batch`` runs for each micro-batch (to send a signal)."""

    precision = "fp32"

    def __init__(self, model: nn.Module) -> None:
        self.raw_model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda _: 1.0)
        self.scaler = self.ema = None
        self.calls: list[tuple] = []
        self.epochs: list[int] = []
        self.on_batch = lambda image_ids: None

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def begin(self) -> None:
        self.calls.append(("begin",))

    def accumulate(self, batch: dict[str, torch.Tensor], group_size: int, *, sync_gradients: bool) -> int:
        image_ids = batch["image"].flatten().tolist()
        self.calls.append(("batch", image_ids, group_size, sync_gradients))
        self.on_batch(image_ids)
        return len(image_ids)

    def update(self) -> None:
        self.calls.append(("update",))

    def take_losses(self) -> torch.Tensor:
        return torch.zeros(2)

    def skipped_steps(self, global_step: int, run_folder: RunFolder) -> int:
        return 0

    def groups(self) -> list[list[int]]:
        """Image ids of each optimizer step, from its begin to its update."""
        groups, current = [], None
        for call in self.calls:
            if call[0] == "begin":
                current = []
            elif call[0] == "batch":
                current.append(call[1])
            else:
                groups.append(current)
                current = None
        return groups


class TinyModel(nn.Linear):
    """A model the checkpoints can describe: its constructor arguments are none."""

    def constructor_args(self) -> dict[str, int]:
        return {}


@dataclass
class FakeDataset:
    """What the loop asks of the training dataset: its epoch (for augmentation) and its file ids (for checkpoints)."""

    n: int
    epochs: list[int] = field(default_factory=list)

    @property
    def ids(self) -> list[str]:
        return [f"image{k}" for k in range(self.n)]

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        # The image holds its index, so the recorded batches show which images each step trained.
        return {"image": torch.tensor([index]), "mask": torch.zeros(1, dtype=torch.long)}


@dataclass
class ScriptedValidator:
    """Stands in for ``Validator``: the validation after epoch k (of the run's ``position``) scores ``dice[k - 1]``."""

    dice: tuple[float, ...]
    position: TrainPosition

    def validate(self) -> tuple[float, int]:
        return self.dice[self.position.epoch - 1], 0


@dataclass
class Run:
    trainer: Trainer
    step: RecordingStep
    interrupts: InterruptFlag
    saves: list[tuple[list[str], int]]
    """Every checkpoint write: (file names, global step)."""
    folder: RunFolder


def make_run(
    tmp_path: Path,
    *,
    n_train: int,
    batch_size: int = 1,
    grad_accum: int = 1,
    epochs: int = 1,
    dice: tuple[float, ...] = (),
    position: TrainPosition | None = None,
    resume_images: int = 0,
    flags: tuple[str, ...] = (),
) -> Run:
    """A single-process Trainer over ``n_train`` images, with ``flags``; the validation after epoch k scores
    ``dice[k - 1]``."""
    step = RecordingStep(TinyModel(1, 1))
    dataset = FakeDataset(n_train)
    sampler = ResumableDistributedSampler(n_train, rank=0, world_size=1, seed=0)
    folder = RunFolder(tmp_path / "run")
    folder.path.mkdir(parents=True)
    parts = TrainParts(
        step=step,  # type: ignore[arg-type]
        data=TrainData(
            train_set=dataset,  # type: ignore[arg-type]
            val_set=dataset,  # type: ignore[arg-type]
            train_dataset=dataset,  # type: ignore[arg-type]
            mask_values=[0, 1],
            n_channels=1,
        ),
        loaders=Loaders(
            train=SharedMemoryGuard(dataset, "--num-workers 0", batch_size=batch_size, sampler=sampler),
            val=None,
            val_sharded=False,
        ),
        batch_plan=BatchPlan(n_train=n_train, batch_size=batch_size, world_size=1, grad_accum=grad_accum),
        config=parse_config(["--epochs", str(epochs), "--log-every", "1000", *flags]),
        run_folder=folder,
        position=position or TrainPosition(),
        resume_images_in_epoch=resume_images,
    )
    interrupts = InterruptFlag()  # never installed: the tests set its signal as the handler would
    trainer = Trainer(CPU_CONTEXT, parts, interrupts)
    trainer.validator = ScriptedValidator(dice, parts.position)  # type: ignore[assignment]
    return Run(trainer, step, interrupts, record_saves(), folder)


class SaveRecorder(logging.Handler):
    """Every checkpoint write, as the Checkpointer's "Saved ... at step N" line names it: (file names, step)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.saves: list[tuple[list[str], int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("Saved %s at step %d"):
            self.saves.append((str(record.args[0]).split(", "), int(record.args[1])))


_CHECKPOINTER_LOG = logging.getLogger(checkpointer.__name__)


def record_saves() -> list[tuple[list[str], int]]:
    recorder = SaveRecorder()
    _CHECKPOINTER_LOG.addHandler(recorder)
    return recorder.saves


@pytest.fixture(autouse=True)
def _checkpointer_log_at_info() -> Iterator[None]:
    level = _CHECKPOINTER_LOG.level
    _CHECKPOINTER_LOG.setLevel(logging.INFO)
    yield
    _CHECKPOINTER_LOG.setLevel(level)
    for handler in [h for h in _CHECKPOINTER_LOG.handlers if isinstance(h, SaveRecorder)]:
        _CHECKPOINTER_LOG.removeHandler(handler)


def test_seven_batches_with_grad_accum_three_make_steps_of_three_three_and_one(tmp_path: Path) -> None:
    run = make_run(tmp_path, n_train=7, grad_accum=3, dice=(0.5,))
    outcome = run.trainer.train()
    position = run.trainer.position
    sizes = [(call[2], call[3]) for call in run.step.calls if call[0] == "batch"]
    # Each micro-batch's loss is divided by its group's size; gradients are all-reduced on a group's last batch only.
    assert sizes == [(3, False), (3, False), (3, True), (3, False), (3, False), (3, True), (1, True)]
    assert [len(group) for group in run.step.groups()] == [3, 3, 1]
    assert sorted(sum(sum(run.step.groups(), []), [])) == list(range(7))  # every image once
    assert (position.epoch, position.global_step, position.step_in_epoch) == (1, 3, 0)
    assert outcome.interrupted_by == 0 and outcome.line.startswith("Training complete (3 steps); best validation Dice")


def test_a_last_smaller_batch_still_closes_its_group(tmp_path: Path) -> None:
    # 7 images in batches of 2: 4 batches (2, 2, 2, 1 images); --grad-accum 3 groups them 3 + 1, over two epochs.
    run = make_run(tmp_path, n_train=7, batch_size=2, grad_accum=3, epochs=2, dice=(0.1, 0.2))
    run.trainer.train()
    assert [[len(batch) for batch in group] for group in run.step.groups()] == [[2, 2, 2], [1], [2, 2, 2], [1]]
    assert run.trainer.position.global_step == 4 and run.trainer.position.epoch == 2


def test_a_resume_continues_the_epoch_at_its_group_boundary(tmp_path: Path) -> None:
    # Resumed after one step of 3 batches (3 images) of epoch 1: the rest, batches 3..6, make steps of 3 and 1.
    position = TrainPosition(epoch=0, global_step=1, step_in_epoch=3)
    run = make_run(tmp_path, n_train=7, grad_accum=3, dice=(0.5,), position=position, resume_images=3)
    run.trainer.train()
    order = run.step.groups()
    assert [len(group) for group in order] == [3, 1]
    full_epoch = make_run(tmp_path / "full", n_train=7, grad_accum=3, dice=(0.5,))
    full_epoch.trainer.train()
    assert order == full_epoch.step.groups()[1:]  # the same images as the uninterrupted epoch's last steps
    assert run.trainer.position.global_step == 3


def test_a_resume_with_a_larger_batch_begins_its_first_step(tmp_path: Path) -> None:
    # Saved after 3 images with batch 1; resumed with batch 2: batch 1 of 2 images, batches_in_epoch = 1 + 2 = 3.
    # Its first micro-batch lies inside the group of batches 0..2, which this process did not start: it must still
    # open its step (begin), or a skipped step would restore another step's BatchNorm statistics.
    position = TrainPosition(epoch=0, global_step=1, step_in_epoch=3)
    run = make_run(tmp_path, n_train=7, batch_size=2, grad_accum=3, dice=(0.5,), position=position, resume_images=3)
    run.trainer.train()
    assert run.step.calls[0] == ("begin",)
    assert [[len(batch) for batch in group] for group in run.step.groups()] == [[2, 2]]
    assert run.trainer.position.global_step == 2


def test_save_points(tmp_path: Path) -> None:
    # 7 batches, --grad-accum 3: steps 1-3 in epoch 1, 4-6 in epoch 2. --save-every-steps 2 saves last.pth at
    # steps 2, 4, 6; every epoch end saves last.pth and checkpoint_epoch{N}.pth (--save-every 1), plus best.pth when
    # the validation Dice improved (epoch 1: 0.4 > -inf; epoch 2: 0.3 is no better).
    run = make_run(tmp_path, n_train=7, grad_accum=3, epochs=2, dice=(0.4, 0.3), flags=("--save-every-steps", "2"))
    run.trainer.train()
    assert run.saves == [
        (["last.pth"], 2),
        (["last.pth", "checkpoint_epoch1.pth", "best.pth"], 3),
        (["last.pth"], 4),
        (["last.pth"], 6),
        (["last.pth", "checkpoint_epoch2.pth"], 6),
    ]
    assert {path.name for path in run.folder.path.glob("*.pth")} == {
        "last.pth",
        "best.pth",
        "checkpoint_epoch1.pth",
        "checkpoint_epoch2.pth",
    }


def test_max_steps_stops_and_saves_once(tmp_path: Path) -> None:
    # --max-steps 2 with steps of 3 batches stops after batch 6 of 7 (the 6th image), with the state of step 2 saved.
    run = make_run(
        tmp_path, n_train=7, grad_accum=3, epochs=3, dice=(0.5,) * 3, flags=("--max-steps", "2", "--save_every", "0")
    )
    outcome = run.trainer.train()
    assert outcome.line == (
        f"Stopped after --max-steps 2; {run.folder.last} holds the state (continue with --resume auto and a larger "
        f"--max-steps)"
    )
    assert outcome.interrupted_by == 0
    assert [len(group) for group in run.step.groups()] == [3, 3]
    assert run.saves == [(["last.pth"], 2)]
    assert (run.trainer.position.global_step, run.trainer.position.step_in_epoch) == (2, 6)


def test_a_signal_stops_at_the_end_of_the_step_it_arrived_in(tmp_path: Path) -> None:
    run = make_run(tmp_path, n_train=7, grad_accum=3, dice=(0.5,))
    trained: list[int] = []

    def signal_during_the_second_batch(image_ids: list[int]) -> None:
        trained.extend(image_ids)
        if len(trained) == 2:
            run.interrupts.signum = signal.SIGTERM

    run.step.on_batch = signal_during_the_second_batch
    outcome = run.trainer.train()
    # The step the signal arrived in is finished (its third batch trained, the update done), then nothing else.
    assert [len(group) for group in run.step.groups()] == [3]
    assert run.step.calls[-1] == ("update",)
    assert outcome.interrupted_by == signal.SIGTERM
    assert outcome.line == (
        f"Stopped by SIGTERM at epoch 1, step 1; saved {run.folder.interrupted}. To continue, run the same command "
        f"with --resume auto (or --resume {run.folder.interrupted})"
    )
    assert run.folder.interrupted.is_file()
    assert run.saves == [(["INTERRUPTED.pth"], 1)]
    position = run.trainer.position
    assert (position.epoch, position.global_step, position.step_in_epoch) == (0, 1, 3)


def test_the_timed_save_is_asked_once_per_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]  # the clock when the checkpointer starts: the first interval starts there
    monkeypatch.setattr(checkpointer, "monotonic", lambda: now[0])
    saver = make_run(tmp_path, n_train=2, flags=("--save-every-minutes", "1")).trainer.checkpointer
    now[0] = 59.0
    assert not saver.timed_save_due()
    now[0] = 60.0
    assert saver.timed_save_due() and not saver.timed_save_due()  # asked once, until the save happens
    saver.save_timed()  # last.pth: the next interval starts now
    now[0] = 119.0
    assert not saver.timed_save_due()
    now[0] = 120.0
    assert saver.timed_save_due()
    never = make_run(tmp_path / "never", n_train=2, flags=("--save-every-minutes", "0")).trainer.checkpointer
    now[0] = 10**6
    assert not never.timed_save_due()


def test_an_agreed_timed_save_writes_last_at_that_step_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The save timer (rank 0) asks at the boundary of step 2; the agreement answers there with one process, and
    # last.pth is written at that step once (not again at the same step), then at the epoch's end as usual.
    # The clock reads 0 s when the timer starts, 30 s at step 1 and 60 s (one minute: due) at step 2.
    clock = itertools.chain([0.0, 30.0, 60.0], itertools.count(61.0))
    monkeypatch.setattr(checkpointer, "monotonic", lambda: next(clock))
    run = make_run(tmp_path, n_train=7, grad_accum=3, dice=(0.5,), flags=("--save-every-minutes", "1"))
    run.trainer.train()
    assert run.saves == [(["last.pth"], 2), (["last.pth", "checkpoint_epoch1.pth", "best.pth"], 3)]


@pytest.mark.parametrize("epochs", [1, 2])
def test_every_epoch_selects_its_order_and_augmentation(tmp_path: Path, epochs: int) -> None:
    run = make_run(tmp_path, n_train=5, dice=(0.5,) * epochs, epochs=epochs)
    run.trainer.train()
    dataset = run.trainer.parts.data.train_dataset
    assert dataset.epochs == list(range(epochs))  # type: ignore[attr-defined]
    assert run.step.epochs == list(range(epochs))  # the step is told each epoch too (--freeze-encoder-epochs)
    images = [call[1][0] for call in run.step.calls if call[0] == "batch"]
    sampler = ResumableDistributedSampler(5, rank=0, world_size=1, seed=0)
    expected = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        expected += list(sampler)
    assert images == expected


def test_patience_counts_the_validations_without_an_improvement_above_min_delta(tmp_path: Path) -> None:
    # Validations scoring 0.5 (the first always improves), 0.505 (the best, but not by more than --min-delta 0.01:
    # count 1), 0.52 (by more: count 0), 0.4 (1), 0.39 (2 = --patience: the run stops after epoch 5 of 6, step 10).
    dice, flags = (0.5, 0.505, 0.52, 0.4, 0.39, 0.3), ("--patience", "2", "--min-delta", "0.01")
    run = make_run(tmp_path, n_train=2, epochs=6, dice=dice, flags=flags)
    outcome = run.trainer.train()
    position = run.trainer.position
    assert (position.epoch, position.validations_without_improvement, position.best_epoch) == (5, 2, 3)
    assert outcome.line == (
        "Stopped at epoch 5, step 10; early stopping: no improvement of validation Dice above 0.01 in 2 validations; "
        "best 0.5200 at epoch 3"
    )
    # The control: without --patience (0: never stops) the same scores train every epoch.
    full = make_run(tmp_path / "full", n_train=2, epochs=6, dice=dice, flags=("--min-delta", "0.01"))
    assert full.trainer.train().line.startswith("Training complete (12 steps)")
    assert full.trainer.position.validations_without_improvement == 3


def test_the_curves_are_drawn_again_only_after_a_record_they_show_and_by_a_validation_once_a_minute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Drawing costs the training process about 0.4 s: a validation redraws at most once a minute, the loop's end always.
    run = make_run(tmp_path, n_train=2)
    run_log, png = run.trainer.run_log, run.folder.curves
    Image.new("RGB", (4, 4)).save(png)  # an older run's figure: the first draw replaces it
    older = png.stat().st_ino
    assert run_log.draw_curves()
    drawn = png.stat()
    assert drawn.st_ino != older  # written as a new file (temporary file and os.replace)
    with run_log.phase("checkpoint"):  # a record the figure does not show
        pass
    assert run_log.draw_curves()
    assert (png.stat().st_ino, png.stat().st_mtime_ns) == (drawn.st_ino, drawn.st_mtime_ns)

    def validate(dice: float) -> None:
        scores = [0.9, dice]
        run_log.log_val(EvalResult(scores, scores, n_images=2, micro_per_class_dice=scores, micro_per_class_iou=scores))

    validate(0.5)  # within a minute of the last draw: not drawn again
    assert png.stat().st_ino == drawn.st_ino and read_series(run.folder.metrics).dice == [(0, 0.5)]
    assert run_log.draw_curves() and png.stat().st_ino != drawn.st_ino, "the end of the run draws what is new"
    monkeypatch.setattr(run_log, "_curves_due", 0.0)  # as a minute after that draw
    drawn = png.stat()
    validate(0.6)
    assert png.stat().st_ino != drawn.st_ino, "a validation a minute after the last draw draws the curves again"


class ImagesOfOnes:
    """Two 1-channel 4x4 images and empty masks: enough for the real validation to score them."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"image": torch.ones(1, 4, 4), "mask": torch.zeros(4, 4, dtype=torch.long)}


@pytest.mark.parametrize("signalled", [False, True])
def test_a_signal_before_the_first_validation_batch_is_a_stop_not_an_empty_validation_set(
    tmp_path: Path, signalled: bool
) -> None:
    run = make_run(tmp_path, n_train=2)  # its interrupt flag is never installed: the test sets its signal
    run.step.raw_model = nn.Conv2d(1, 2, kernel_size=1)
    loaders = dataclasses.replace(run.trainer.parts.loaders, val=DataLoader(ImagesOfOnes(), batch_size=1))
    parts = dataclasses.replace(run.trainer.parts, loaders=loaders)
    validator = Validator(CPU_CONTEXT, parts, interrupts=run.interrupts, run_log=RunLog(CPU_CONTEXT, parts))
    if not signalled:
        # The control: the same validation without a signal scores both images.
        dice, stopped = validator.validate()
        assert 0.0 <= dice <= 1.0 and stopped == 0
        return
    run.interrupts.signum = signal.SIGTERM  # as the handler records it, before validation's first batch
    assert validator.validate() == (None, signal.SIGTERM)
