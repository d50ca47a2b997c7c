"""Micro (dataset-level) and macro (per-image mean) Dice/IoU, in evaluate.py's JSON and the validation log."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import checkpoint_payload, make_model, read_metrics
from utils.checkpoint.files import save_checkpoint_atomic
from utils.evaluation import SegmentationMetrics


def test_micro_and_macro_hand_checked() -> None:
    """Image A: truth [1, 1], prediction [1, 0]. Image B: truth [0, 0], prediction [0, 0] (class 1 absent: 1)."""
    metrics = SegmentationMetrics(n_classes=2)
    metrics.update(torch.tensor([[[1, 0]], [[0, 0]]]), torch.tensor([[[1, 1]], [[0, 0]]]))
    result = metrics.compute()
    # Macro, per image then averaged: class 0 (0 + 1) / 2, class 1 (2/3 + 1) / 2.
    assert result.per_class_dice == pytest.approx([0.5, 5 / 6])
    # Micro, counts summed first: class 0 TP 2 FP 1 FN 0 -> 4/5; class 1 TP 1 FP 0 FN 1 -> 2/3.
    assert result.micro_per_class_dice == pytest.approx([0.8, 2 / 3])
    assert result.micro_per_class_iou == pytest.approx([2 / 3, 0.5])
    reductions = result.as_dict()["reductions"]
    assert reductions["micro"]["dice"] == pytest.approx(2 / 3)  # foreground classes only
    assert reductions["micro"]["dice_with_background"] == pytest.approx((0.8 + 2 / 3) / 2)
    assert reductions["macro"]["dice"] == pytest.approx(5 / 6) == result.dice
    assert "per image" in reductions["macro"]["reduction"] and "summed" in reductions["micro"]["reduction"]


@pytest.fixture
def self_labelled_void(tmp_path: Path, carvana_data, self_labelled_masks) -> tuple[Path, Path, Path, np.ndarray]:
    """A 3-class model trained with --ignore-value 255 (as its checkpoint says) and its own predictions as masks."""
    model = make_model(3)
    payload = {**checkpoint_payload(model, [0, 1, 2]), "args": {"ignore_values": [255], "scale": 1.0}}
    checkpoint = tmp_path / "m.pth"
    save_checkpoint_atomic(payload, checkpoint)
    masks = self_labelled_masks(checkpoint)
    frame = None
    for path in sorted(masks.glob("*.png")):
        with Image.open(path) as img:
            labels = np.array(img)
        assert 255 not in labels  # predict never writes the void value
        frame = np.ones(labels.shape, dtype=bool)
        frame[2:-2, 2:-2] = False
    return checkpoint, carvana_data.imgs, masks, frame


def _evaluate(checkpoint: Path, images: Path, masks: Path, report: Path) -> int:
    """evaluate.main in this process (the script as a process is tested in tests/training/test_faults_trust.py)."""
    import evaluate

    return evaluate.main(["-m", str(checkpoint), "--imgs", str(images), "--masks", str(masks), "-s", "1", "--json",
                          str(report), "--no-progress", "--workers", "0"])  # fmt: skip


@pytest.mark.slow
def test_evaluate_ignores_void_borders_and_reports_both_reductions(self_labelled_void, tmp_path: Path) -> None:
    checkpoint, images, masks, frame = self_labelled_void
    # The model's own predictions with a void frame: still perfect, whatever it predicts on the frame.
    for path in masks.glob("*.png"):
        labels = np.array(Image.open(path))
        labels[frame] = 255
        Image.fromarray(labels).save(path)
    report = tmp_path / "void.json"
    assert _evaluate(checkpoint, images, masks, report) == 0
    scores = json.loads(report.read_text())
    assert scores["mask_values"] == [0, 1, 2]
    for name in ("micro", "macro"):
        assert scores["reductions"][name]["per_class_dice"] == [1.0, 1.0, 1.0]
        assert scores["reductions"][name]["dice"] == 1.0 and scores["reductions"][name]["dice_with_background"] == 1.0
    assert "absent" in scores["absent_class"]

    # Control: the frame labelled with a wrong class instead lowers the score.
    for path in masks.glob("*.png"):
        labels = np.array(Image.open(path))
        labels[frame] = 1
        Image.fromarray(labels).save(path)
    assert _evaluate(checkpoint, images, masks, report) == 0
    assert json.loads(report.read_text())["reductions"]["micro"]["dice_with_background"] < 1.0


def test_the_validation_log_records_both_reductions(runner) -> None:
    assert runner.main("reduced", "-e", "1", "-v", "25") == 0
    (event,) = read_metrics(runner.run_dir("reduced"), event="val")
    micro, macro = event["reductions"]["micro"], event["reductions"]["macro"]
    assert macro["dice"] == pytest.approx(event["dice"]) and macro["per_class_dice"] == event["per_class_dice"]
    assert len(micro["per_class_dice"]) == 2 and 0 <= micro["dice"] <= 1 and "summed" in micro["reduction"]
