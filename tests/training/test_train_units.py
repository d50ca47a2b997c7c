"""Pure pieces of the training stack on hand-made inputs: shards, loss, schedule, curves, checkpoint rotation."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DistributedSampler

from utils.checkpoint.files import save_checkpoint_atomic
from utils.checkpoint.format import capture_rng_state, restore_rng_state
from utils.checkpoint.run_folder import RunFolder
from utils.errors import CheckpointError
from utils.evaluation import dice_loss
from utils.launch.signals import InterruptFlag, signal_exit_code
from utils.training.curves import build_figure, read_series, write_curves_if_possible
from utils.training.objective import StepSchedule, segmentation_loss
from utils.training.sampler import (
    BatchPlan,
    ResumableDistributedSampler,
    epoch_order,
    shard_indices,
)


@pytest.mark.parametrize(("n", "world_size"), [(10, 1), (10, 2), (11, 2), (7, 3)])
def test_sampler_matches_distributed_sampler(n: int, world_size: int) -> None:
    for rank in range(world_size):
        ours = ResumableDistributedSampler(n, rank=rank, world_size=world_size, seed=3)
        reference = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=True, seed=3)
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            reference.set_epoch(epoch)
            assert list(ours) == list(reference) and len(ours) == len(reference)


def test_order_depends_only_on_seed_and_epoch() -> None:
    assert epoch_order(20, seed=1, epoch=2) == epoch_order(20, seed=1, epoch=2)
    assert epoch_order(20, seed=1, epoch=2) != epoch_order(20, seed=1, epoch=3)
    assert sorted(epoch_order(20, seed=1, epoch=2)) == list(range(20))


def test_shards_are_disjoint_and_cover_the_epoch() -> None:
    order = epoch_order(12, seed=0, epoch=0)
    shards = [shard_indices(order, rank=r, world_size=3) for r in range(3)]
    assert sorted(sum(shards, [])) == list(range(12))


def test_global_batches_do_not_depend_on_the_world_size() -> None:
    # Rank r takes every W-th image, so global batch k of W ranks with batch b is batch k of one rank with batch W*b.
    order = epoch_order(16, seed=0, epoch=1)
    single = shard_indices(order, rank=0, world_size=1)
    per_rank = [shard_indices(order, rank=r, world_size=2) for r in range(2)]
    for k in range(4):
        assert sorted(single[4 * k : 4 * k + 4]) == sorted(
            per_rank[0][2 * k : 2 * k + 2] + per_rank[1][2 * k : 2 * k + 2]
        )


@pytest.mark.parametrize(("n", "world_size", "batch"), [(16, 2, 2), (15, 2, 2), (13, 3, 2)])
def test_resuming_slices_the_index_list(n: int, world_size: int, batch: int) -> None:
    order = epoch_order(n, seed=5, epoch=0)
    plan = BatchPlan(n_train=n, batch_size=batch, world_size=world_size)
    for done in range(plan.batches_in_epoch() + 1):
        consumed = plan.images_consumed(done)
        assert plan.batches_done(consumed) == done and plan.batches_in_epoch(consumed) == plan.batches_in_epoch()
        for rank in range(world_size):
            full = shard_indices(order, rank=rank, world_size=world_size)
            assert shard_indices(order, rank=rank, world_size=world_size, consumed=consumed) == full[done * batch :]


def test_resuming_with_another_world_size_continues_from_the_same_image() -> None:
    order = epoch_order(20, seed=0, epoch=0)
    consumed = BatchPlan(n_train=20, batch_size=2, world_size=2).images_consumed(2)  # 2 steps of 2 ranks x 2 images
    assert consumed == 8
    rest = [shard_indices(order, rank=r, world_size=4, consumed=consumed) for r in range(4)]
    assert sorted(sum(rest, [])) == sorted(order[8:])


def test_sampler_length_after_skipping() -> None:
    sampler = ResumableDistributedSampler(15, rank=1, world_size=2, seed=0)
    sampler.set_epoch(0, consumed=4)
    assert len(sampler) == len(list(sampler)) == 6


def _batch(n: int, n_classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, max(n_classes, 1), 8, 8, generator=generator)
    masks = torch.randint(0, max(n_classes, 2), (n, 8, 8), generator=generator)
    return logits, masks


@pytest.mark.parametrize("n_classes", [1, 2, 3])
def test_training_loss_decomposes_over_ranks(n_classes: int) -> None:
    # DDP averages the ranks' gradients; that equals the gradient of the global batch only if the loss is a mean over
    # images. Per-image Dice makes it one; milesial's batch-volume Dice is not (checked below).
    logits, masks = _batch(4, n_classes, seed=n_classes)
    whole = segmentation_loss(logits, masks, n_classes)
    halves = segmentation_loss(logits[:2], masks[:2], n_classes) + segmentation_loss(logits[2:], masks[2:], n_classes)
    assert torch.allclose(whole, halves / 2, rtol=1e-6, atol=1e-7)


def test_batch_volume_dice_would_not_decompose() -> None:
    probabilities = torch.tensor([[[1.0, 1.0]], [[0.0, 0.0]]])  # image 0 all foreground, image 1 empty prediction
    target = torch.tensor([[[1.0, 0.0]], [[1.0, 1.0]]])
    whole = dice_loss(probabilities, target)
    halves = (dice_loss(probabilities[:1], target[:1]) + dice_loss(probabilities[1:], target[1:])) / 2
    assert not torch.isclose(whole, halves)


def test_binary_loss_is_bce_plus_dice() -> None:
    logits = torch.full((1, 1, 2, 2), 20.0)
    masks = torch.ones(1, 2, 2, dtype=torch.long)
    assert segmentation_loss(logits, masks, 1).item() == pytest.approx(0.0, abs=1e-6)


def test_cosine_schedule() -> None:
    cosine = StepSchedule(10)
    assert cosine(0) == 1.0
    assert cosine(5) == pytest.approx(0.5)
    assert cosine(10) == pytest.approx(0.0)
    assert cosine(12) == pytest.approx(0.0)
    assert all(cosine(s) >= cosine(s + 1) for s in range(10))


def test_curves_png(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    events = [
        {"event": "train", "epoch": 1 + (s > 3), "global_step": s, "loss": 1.0 / s, "lr": 1e-3, "images_per_s": 10.0,
         "time": 100.0 + 2 * s}
        for s in range(1, 6)
    ]  # fmt: skip
    events += [
        {"event": "val", "global_step": 5, "dice": 0.4, "per_class_dice": [0.9, 0.4]},
        {"event": "train", "epoch": 2, "global_step": 5, "loss": 0.1, "lr": 5e-4, "time": 110.0},
    ]
    metrics.write_text("\n".join(json.dumps(e) for e in events) + "\n{truncated")
    series = read_series(metrics)
    assert series.loss[-1] == (5, 0.1) and len(series.loss) == 5  # a re-logged step keeps its last value
    assert series.dice == [(5, 0.4)]
    assert series.per_class_dice == {0: [(5, 0.9)], 1: [(5, 0.4)]}
    assert series.learning_rate[-1] == (5, 5e-4)
    # Epoch 1 logged steps 1..3 two seconds apart: 3 steps x 2 s; epoch 2 ran steps 4..5 at 2 s each.
    assert series.epoch_seconds == [(1, pytest.approx(6.0)), (2, pytest.approx(4.0))]

    figure = build_figure(series)
    titles = [axes.get_title() for axes in figure.axes]
    assert titles == ["Training loss", "Validation Dice", "Learning rate", "Throughput", "Training time per epoch"]
    assert all(axes.get_xlabel() and axes.get_ylabel() for axes in figure.axes)
    # One validation is one point, drawn with a marker (the old drawing showed a lone dot without a scale).
    dice_lines = {line.get_label(): line for line in figure.axes[1].get_lines()}
    # Class 1 is the only foreground class: its line would lie under the mean's, so the mean's label names it instead.
    assert sorted(dice_lines) == ["class 0", "mean (foreground) = class 1"]
    mean_line = dice_lines["mean (foreground) = class 1"]
    assert list(mean_line.get_ydata()) == [0.4] and mean_line.get_marker() == "o"

    assert write_curves_if_possible(metrics, tmp_path / "curves.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "metrics.jsonl"]  # no temporary left
    with Image.open(tmp_path / "curves.png") as image:
        assert image.format == "PNG" and image.size == (14 * 80, 8 * 80)
        pixels = np.asarray(image.convert("RGB")).reshape(-1, 3).astype(int)
    # Something was drawn in the loss colour.
    assert (np.abs(pixels - [31, 119, 180]).sum(axis=1) < 30).sum() > 50


def _dice_legend(metrics: Path) -> list[str]:
    dice_axes = next(axes for axes in build_figure(read_series(metrics)).axes if axes.get_title() == "Validation Dice")
    return [text.get_text() for text in dice_axes.get_legend().get_texts()]


def test_a_binary_task_draws_its_one_foreground_class_as_the_mean_not_hidden_under_it(tmp_path: Path) -> None:
    binary, three = tmp_path / "binary.jsonl", tmp_path / "three.jsonl"
    for step, (background, car) in enumerate([(0.9, 0.5), (0.95, 0.7)], start=1):
        record = {"event": "val", "epoch": step, "global_step": step}
        with open(binary, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({**record, "dice": car, "per_class_dice": [background, car]}) + "\n")
        with open(three, "a", encoding="utf-8") as handle:
            handle.write(
                json.dumps({**record, "dice": (car + 0.3) / 2, "per_class_dice": [background, car, 0.3]}) + "\n"
            )
    assert _dice_legend(binary) == ["class 0", "mean (foreground) = class 1"]
    assert _dice_legend(three) == ["class 0", "class 1", "class 2", "mean (foreground)"]


def test_prune_keeps_the_newest_epoch_files(tmp_path: Path) -> None:
    for epoch in (1, 2, 3, 10):
        (tmp_path / f"checkpoint_epoch{epoch}.pth").write_bytes(b"x")
    (tmp_path / "best.pth").write_bytes(b"x")
    removed = RunFolder(tmp_path).prune_epoch_checkpoints(keep_last=2)
    assert sorted(p.name for p in removed) == ["checkpoint_epoch1.pth", "checkpoint_epoch2.pth"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pth", "checkpoint_epoch10.pth", "checkpoint_epoch3.pth"]
    assert RunFolder(tmp_path).prune_epoch_checkpoints(keep_last=0) == []


def test_resume_auto_skips_corrupt_and_incomplete_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    good = {
        "format_version": 1,
        "model_state": {"w": torch.ones(1)},
        "optimizer": {},
        "scheduler": {},
        "epoch": 1,
        "global_step": 4,
        "step_in_epoch": 0,
    }
    save_checkpoint_atomic(good, tmp_path / "checkpoint_epoch1.pth")  # with its digests, as every file of ours
    torch.save({"w": torch.ones(1)}, tmp_path / "best.pth")  # weights only: cannot be resumed
    # Incomplete (no optimizer) at a further step: ranked first by its position, then skipped when read in full.
    incomplete = {key: value for key, value in good.items() if key != "optimizer"}
    save_checkpoint_atomic({**incomplete, "global_step": 5}, tmp_path / "checkpoint_epoch2.pth")
    (tmp_path / "last.pth").write_bytes(b"PK\x03\x04 truncated")
    for age, name in enumerate(["last.pth", "best.pth", "checkpoint_epoch1.pth"]):
        os.utime(tmp_path / name, ns=(10**18 - age * 10**9, 10**18 - age * 10**9))
    path, state = RunFolder(tmp_path).find_resume_checkpoint()
    assert path.name == "checkpoint_epoch1.pth" and state.position.global_step == 4
    assert "skipping" in caplog.text and "checkpoint_epoch2.pth" in caplog.text
    assert RunFolder(tmp_path / "empty").find_resume_checkpoint() is None  # nothing yet: --resume auto starts a new run
    (tmp_path / "checkpoint_epoch1.pth").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        RunFolder(tmp_path).find_resume_checkpoint()


def test_rng_state_round_trip_through_a_weights_only_file(tmp_path: Path) -> None:
    import random

    import numpy as np

    torch.save({"rng": capture_rng_state()}, tmp_path / "rng.pth")
    expected = (torch.rand(3), np.random.rand(3), random.random())
    restore_rng_state(torch.load(tmp_path / "rng.pth", weights_only=True)["rng"])
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], again[0]) and (expected[1] == again[1]).all() and expected[2] == again[2]


def test_interrupt_flag_records_the_first_signal() -> None:
    # The handlers found before, not Python's defaults: a background job (`cmd &`) starts with SIGINT ignored.
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    flag = InterruptFlag().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert flag.signum == signal.SIGTERM
    finally:
        flag.restore()
    assert {signum: signal.getsignal(signum) for signum in before} == before
    assert signal_exit_code(signal.SIGINT) == 130 and signal_exit_code(signal.SIGTERM) == 143


def test_steps_per_epoch() -> None:
    assert BatchPlan(n_train=15, batch_size=2, world_size=2).batches_in_epoch() == 4
    assert BatchPlan(n_train=16, batch_size=4, world_size=1).batches_in_epoch() == 4
    # 15 images, 1 process, batch 2: 8 batches; with 3 accumulated per step, 3 steps (the last of 2 batches).
    plan = BatchPlan(n_train=15, batch_size=2, world_size=1, grad_accum=3)
    assert (plan.batches_in_epoch(), plan.steps_per_epoch, plan.total_steps(4)) == (8, 3, 12)
    two = BatchPlan(n_train=15, batch_size=2, world_size=2, grad_accum=2)
    assert (two.global_batch, two.images_per_step, two.batches_in_epoch(), two.steps_per_epoch) == (4, 8, 4, 2)


def test_batch_plan_of_a_resume_with_another_batch_size() -> None:
    # A run saved after 3 batches of 2 images on 2 ranks (12 images of 15) resumes with batch 4 on one rank: it counts
    # 12 // 4 = 3 batches done and trains the remaining 3 images in one more batch, so its epoch ends at batch 4.
    plan = BatchPlan(n_train=15, batch_size=4, world_size=1, grad_accum=2)
    assert (plan.batches_done(12), plan.images_per_rank(12), plan.batches_in_epoch(12)) == (3, 3, 4)
    # 5 images of 15 done: 1 whole batch of 4 counted, 10 left, 3 batches: the epoch ends at batch 4 too.
    assert (plan.batches_done(5), plan.batches_in_epoch(5)) == (1, 4)
    assert BatchPlan(n_train=15, batch_size=2, world_size=2).images_per_rank(12) == 2  # 3 images padded to 4


@pytest.mark.parametrize(
    ("batches", "grad_accum", "groups"),
    [(7, 3, [(0, 3), (3, 3), (6, 1)]), (6, 3, [(0, 3), (3, 3)]), (4, 1, [(0, 1), (1, 1), (2, 1), (3, 1)])],
)
def test_accumulation_groups(batches: int, grad_accum: int, groups: list[tuple[int, int]]) -> None:
    plan = BatchPlan(n_train=batches, batch_size=1, world_size=1, grad_accum=grad_accum)
    found = [plan.accumulation_group(index, plan.batches_in_epoch()) for index in range(batches)]
    assert all(index in group for index, group in enumerate(found))
    assert sorted({(group.start, len(group)) for group in found}) == groups
    closing = [index for index, group in enumerate(found) if index == group[-1]]
    assert closing == [start + size - 1 for start, size in groups]
    assert len(closing) == plan.steps_per_epoch
