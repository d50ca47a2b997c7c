"""Void labels (--ignore-value) and class imbalance (--class-weights, --oversample-foreground) through training."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import (
    REPO_ROOT,
    SyntheticData,
    TrainRunner,
    assert_same_training_state,
    child_env,
    finish,
    load_checkpoint,
    torchrun_prefix,
)
from tests.helpers import one_error_line, paint_void_borders
from utils.datasets.mask_values import IGNORE_INDEX
from utils.errors import ConfigError
from utils.evaluation import SegmentationMetrics
from utils.flags import parse_class_weights
from utils.training.objective import auto_class_weights, segmentation_loss
from utils.training.sampler import epoch_order, shard_indices


@pytest.fixture(scope="module")
def void_data(tmp_path_factory: pytest.TempPathFactory) -> SyntheticData:
    """8 three-class 48x32 images whose masks have a 2-pixel void (255) frame."""
    from utils.datasets.synthetic import generate_carvana_like

    root = tmp_path_factory.mktemp("void_train")
    generate_carvana_like(root, 8, size=(48, 32), n_classes=3, seed=1)
    paint_void_borders(root / "masks", width=2)
    return SyntheticData(root / "imgs", root / "masks", 8)


# ------------------------------------------------------------------------------------------------- the loss


@pytest.mark.parametrize("n_classes", [1, 3])
def test_void_pixels_count_nowhere_in_the_loss(n_classes: int) -> None:
    """The loss of a void-framed mask is the loss of its interior alone, and void logits get no gradient."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, n_classes, 8, 10, generator=generator, requires_grad=True)
    masks = torch.randint(0, max(n_classes, 2), (2, 8, 10), generator=generator)
    framed = torch.full_like(masks, IGNORE_INDEX)
    framed[:, 2:-2, 2:-2] = masks[:, 2:-2, 2:-2]
    loss = segmentation_loss(logits, framed, n_classes)
    interior = segmentation_loss(logits[:, :, 2:-2, 2:-2], masks[:, 2:-2, 2:-2], n_classes)
    assert loss.item() == pytest.approx(interior.item(), rel=1e-6)
    loss.backward()
    assert torch.all(logits.grad[:, :, :2] == 0) and logits.grad[:, :, 2:-2, 2:-2].abs().sum() > 0


def test_class_weights_weight_each_images_cross_entropy() -> None:
    """Per image, PyTorch's weighted cross-entropy mean; the Dice term is unchanged."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 4, 5, generator=generator)
    masks = torch.randint(0, 3, (2, 4, 5), generator=generator)
    weights = torch.tensor([1.0, 5.0, 5.0])
    expected_ce = sum(F.cross_entropy(logits[i : i + 1], masks[i : i + 1], weight=weights) for i in range(2)) / 2
    plain_ce = sum(F.cross_entropy(logits[i : i + 1], masks[i : i + 1]) for i in range(2)) / 2
    difference = segmentation_loss(logits, masks, 3, weights) - segmentation_loss(logits, masks, 3)
    assert difference.item() == pytest.approx((expected_ce - plain_ce).item(), rel=1e-5)


def test_auto_class_weights_from_hand_made_counts() -> None:
    # f = 0.9, 0.09, 0.01 -> 1/f = 1.11, 11.1, 100 -> clipped at 10 x 1.11 -> normalised to a mean of 1.
    assert auto_class_weights([900, 90, 10]) == pytest.approx([1 / 7, 10 / 7, 10 / 7])
    assert auto_class_weights([500, 500]) == pytest.approx([1.0, 1.0])
    # A class with no pixel gets the cap.
    assert auto_class_weights([100, 0]) == pytest.approx([2 / 11, 20 / 11])
    assert auto_class_weights([300, 100], max_ratio=100) == pytest.approx([0.5, 1.5])


def test_class_weight_flag_errors() -> None:
    assert parse_class_weights("auto", 3) is None
    assert parse_class_weights("1,5,5", 3) == (1.0, 5.0, 5.0)
    assert parse_class_weights("1,4", 1) == (1.0, 4.0)
    with pytest.raises(ConfigError, match=r"gives 2 weight\(s\) but --classes 3 needs 3"):
        parse_class_weights("1,5", 3)
    with pytest.raises(ConfigError, match="--class-weights must be a finite number above 0"):
        parse_class_weights("1,0,5", 3)
    with pytest.raises(ConfigError, match="'auto' or numbers separated by commas"):
        parse_class_weights("heavy", 3)


# ------------------------------------------------------------------------------------------------ metrics


def test_metrics_ignore_void_pixels_hand_checked() -> None:
    """A 2x3 image, one void pixel predicted wrongly: it changes nothing."""
    target = torch.tensor([[[0, 1, IGNORE_INDEX], [1, 1, 0]]])
    pred = torch.tensor([[[0, 1, 1], [0, 1, 0]]])
    metrics = SegmentationMetrics(n_classes=2)
    metrics.update(pred, target)
    result = metrics.compute()
    # Class 0: TP 2 (two zeros right), FP 1 (a 1 predicted 0), FN 0 -> Dice 4/5, IoU 2/3.
    # Class 1: TP 2, FP 0, FN 1 -> Dice 4/5, IoU 2/3. The void pixel (predicted 1) would have been a class-1 FP.
    assert result.per_class_dice == pytest.approx([0.8, 0.8])
    assert result.per_class_iou == pytest.approx([2 / 3, 2 / 3])


# ----------------------------------------------------------------------------------------------- sampling


def test_oversampling_fraction_over_an_epoch() -> None:
    """40 images, 8 with foreground: P=0.5 on 2 ranks puts one forced image in each rank's every batch of 2."""
    foreground = list(range(8))

    def oversampled(fraction: float = 0.5, epoch: int = 2) -> list[int]:
        return epoch_order(40, seed=3, epoch=epoch, foreground=foreground, fraction=fraction, world_size=2)

    order = oversampled()
    assert order == oversampled() and order != oversampled(epoch=3)
    assert oversampled(fraction=0.0) == epoch_order(40, seed=3, epoch=2)
    for rank in range(2):
        shard = shard_indices(order, rank=rank, world_size=2)
        batches = [shard[i : i + 2] for i in range(0, len(shard), 2)]
        assert all(any(index in foreground for index in batch) for batch in batches)
        fraction = sum(index in foreground for index in shard) / len(shard)
        assert 0.5 <= fraction <= 0.5 + 0.5 * 8 / 40 + 0.1  # forced half, plus the other half's natural share
    plain = shard_indices(epoch_order(40, seed=3, epoch=2), rank=0, world_size=2)
    assert sum(index in foreground for index in plain) / len(plain) < 0.5


# ---------------------------------------------------------------------------------------- train.py runs


@pytest.mark.slow
def test_a_void_bordered_dataset_trains_with_weights_and_oversampling(
    void_data: SyntheticData, tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    # In this process: train.py's exit status and error line as a process are tested in test_train_single.py.
    runner = TrainRunner(void_data, tmp_path)
    common = ("-c", "3", "-v", "25", "-e", "1", "--log-every", "1")
    assert runner.main("plain", *common) == 2
    assert "contain 4 distinct values (0, 1, 2, 255) but n_classes=3" in one_error_line(capsys.readouterr().err)

    extra = ("--ignore-value", "255", "--class-weights", "auto", "--oversample-foreground", "0.5")
    with caplog.at_level(logging.INFO):
        assert runner.main("void", *common, *extra) == 0
    assert "are void (mask value(s) 255)" in caplog.text and "--class-weights auto: class pixel counts" in caplog.text
    last = load_checkpoint(runner.run_dir("void") / "last.pth")
    assert last["mask_values"] == [0, 1, 2]
    args = last["args"]
    assert (args["ignore_values"], args["class_weights"], args["oversample_foreground"]) == ([255], "auto", 0.5)


def test_resume_is_bit_exact_with_oversampling(void_data: SyntheticData, tmp_path: Path) -> None:
    runner = TrainRunner(void_data, tmp_path)
    # 6 training images, batch 2: 3 steps per epoch; the interrupted run stops mid-epoch 2.
    flags = ("-c", "3", "-v", "25", "-e", "2", "--ignore-value", "255", "--oversample-foreground", "0.5")
    assert runner.main("straight", *flags, "--class-weights", "1,2,3") == 0
    assert runner.main("halted", *flags, "--class-weights", "1,2,3", "--max-steps", "4", "--resume") == 0
    assert load_checkpoint(runner.run_dir("halted") / "last.pth")["step_in_epoch"] == 1
    assert runner.main("halted", *flags, "--class-weights", "1,2,3", "--resume") == 0
    assert_same_training_state(runner.run_dir("straight") / "last.pth", runner.run_dir("halted") / "last.pth")
    # Oversampling changes the order: the run without it ends elsewhere.
    assert runner.main("unsampled", *flags[:-2], "--class-weights", "1,2,3") == 0
    a = load_checkpoint(runner.run_dir("straight") / "last.pth")["model_state"]
    b = load_checkpoint(runner.run_dir("unsampled") / "last.pth")["model_state"]
    assert any(not torch.equal(a[key], b[key]) for key in a)


@pytest.mark.slow
def test_two_ranks_train_void_labels_with_weights_and_oversampling(void_data: SyntheticData, tmp_path: Path) -> None:
    """Each rank computes the same weights and its own share of the oversampled order; they step in lockstep."""
    runner = TrainRunner(void_data, tmp_path)
    flags = ("--ddp_mode", "-c", "3", "-v", "25", "-e", "1", "--batch-size", "1", "--ignore-value", "255",
             "--class-weights", "auto", "--oversample-foreground", "0.5")  # fmt: skip
    process = subprocess.Popen(
        [*torchrun_prefix(2), "train.py", *runner.args("void_ddp", *flags)],
        cwd=REPO_ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    out, err = finish(process, timeout=600)
    assert process.returncode == 0, err
    last = load_checkpoint(runner.run_dir("void_ddp") / "last.pth")
    # 6 training images on 2 ranks, batch 1: 3 steps.
    assert (last["world_size"], last["global_step"], last["mask_values"]) == (2, 3, [0, 1, 2])
