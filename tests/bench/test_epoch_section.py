"""The epoch section: the wall-time split from phase records, the run-log check, forward FLOPs, the milesial stand-in's
metric and mask mapping, and a real quick section through the benchmark's command line (train.py and the stand-in
alternating, two pairs); tests/bench/test_benchmark.py's quick run leaves this section to this file.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from scripts.bench.epoch import split_wall_time
from scripts.bench.flops import inference_flops_per_image
from scripts.bench.milesial_baseline import dice_coefficient, multiclass_dice_coefficient, preprocess
from scripts.bench.processes import MeasurementError
from scripts.bench.run_log import check_precision, run_summary
from tests.bench.conftest import RunBenchmark
from tests.helpers import positive
from unet import UNet

LOG = (
    "20:52:21 INFO Starting training: epochs 1..1, batch size 4 per process x 1 process x 1 accumulation = 4, "
    "learning rate 1e-05, 58 training / 6 validation images, scale 0.5, precision bf16, device cpu, 2 CPU threads "
    "and 0 loader workers per process, run folder runs/epoch-bf16\n"
)


def phase(name: str, seconds: float, end: float) -> dict:
    return {"event": "phase", "phase": name, "seconds": seconds, "time": end}


def test_the_split_adds_up_to_the_wall_time_and_curves_inside_validation_count_as_curves() -> None:
    events = [
        phase("loop_start", 0.0, 105.0),  # launched at 100: 5 s of start-up
        {"event": "train", "global_step": 1, "images_seen": 4, "time": 110.0},
        phase("curves", 0.5, 121.0),  # the redraw after the validation, inside it
        phase("validation", 2.0, 121.0),  # 119..121: the steps ran 105..119
        phase("checkpoint", 1.0, 122.5),
        phase("curves", 0.25, 123.0),
    ]
    split = split_wall_time(events, launched=100.0, wall_s=24.0)
    assert split == pytest.approx(
        {"startup": 5.0, "steps": 14.0, "validation": 1.5, "checkpoint": 1.0, "curves": 0.75, "rest": 1.75}
    )
    with pytest.raises(MeasurementError, match="no loop_start record"):
        split_wall_time(events[1:], launched=100.0, wall_s=24.0)


def test_the_run_log_names_what_the_run_really_did() -> None:
    assert run_summary(LOG) == {
        "precision": "bf16",
        "device": "cpu",
        "threads": 2,
        "loader_workers": 0,
        "train_images": 58,
        "val_images": 6,
    }
    assert check_precision(LOG, "bf16", "e2e-bf16")["threads"] == 2
    with pytest.raises(MeasurementError, match="e2e-fp32: the row is fp32 but train.py trained in bf16"):
        check_precision(LOG, "fp32", "e2e-fp32")
    one = LOG.replace("2 CPU threads", "1 CPU thread").replace("0 loader workers", "1 loader worker")
    assert (run_summary(one)["threads"], run_summary(one)["loader_workers"]) == (1, 1)
    with pytest.raises(MeasurementError, match="no 'Starting training"):
        run_summary("20:52:21 INFO Creating dataset with 64 examples\n")


def test_forward_flops_of_a_convolution() -> None:
    # 3 -> 8 channels, 3x3, on 10x6 with padding: 2 FLOPs per multiply-add, per output pixel.
    flops = inference_flops_per_image(lambda: nn.Conv2d(3, 8, 3, padding=1), channels=3, height=6, width=10)
    assert flops == 2 * 3 * 8 * 9 * 6 * 10


def test_the_stand_ins_dice_has_known_answers() -> None:
    full = torch.ones(2, 4, 4)
    empty = torch.zeros(2, 4, 4)
    half = torch.zeros(2, 4, 4)
    half[:, :2] = 1
    assert dice_coefficient(full, full).item() == pytest.approx(1.0)
    assert dice_coefficient(empty, empty).item() == pytest.approx(1.0), "nothing predicted of nothing: perfect"
    assert dice_coefficient(full, empty).item() == pytest.approx(0.0, abs=1e-6)
    assert dice_coefficient(half, full).item() == pytest.approx(2 * 8 / (8 + 16))
    # Two classes as (N, C, H, W): class 0 perfect, class 1 disjoint -> the mean over the N * C maps.
    prediction = torch.stack([full, empty], dim=1)
    target = torch.stack([full, full], dim=1)
    assert multiclass_dice_coefficient(prediction, target).item() == pytest.approx(0.5)


def test_the_stand_in_maps_mask_values_to_classes_and_scales_images() -> None:
    mask = Image.fromarray(np.array([[0, 255, 255, 0], [255, 0, 0, 255]], dtype=np.uint8))
    classes = preprocess([0, 255], mask, 1.0, is_mask=True)
    assert classes.dtype == np.int64 and classes.tolist() == [[0, 1, 1, 0], [1, 0, 0, 1]]
    image = Image.fromarray(np.full((4, 6, 3), 255, dtype=np.uint8))
    pixels = preprocess([0, 255], image, 0.5, is_mask=False)
    assert pixels.shape == (3, 2, 3) and np.allclose(pixels, 1.0)
    with pytest.raises(ValueError, match="--scale 0.1 leaves no pixels"):
        preprocess([0, 255], image, 0.1, is_mask=False)


@pytest.mark.slow
def test_the_section_alternates_train_py_with_the_milesial_stand_in(run_benchmark: RunBenchmark) -> None:
    run = run_benchmark(["--quick", "--sections", "epoch", "--repeat", "2"])
    result, work_dir = run.doc["epoch"], run.work_dir

    ours, stand_in = result["wall_s_runs"], result["milesial_baseline"]["wall_s_runs"]
    assert len(ours) == len(stand_in) == 2 and all(map(positive, ours + stand_in))
    ratios = [theirs / mine for mine, theirs in zip(ours, stand_in, strict=True)]
    assert result["milesial_ratios"] == pytest.approx(ratios)
    assert result["milesial_ratio"] == pytest.approx(statistics.median(ratios))
    # The stand-in really trained an epoch in train.py's precision and saved milesial's checkpoint.
    baseline = result["milesial_baseline"]
    assert baseline["precision"] == result["run"]["precision"] == "bf16"
    images = (result["train_images"], result["val_images"])
    assert (baseline["train_images"], baseline["val_images"]) == images == (9, 1)
    saved = torch.load(baseline["checkpoint"], map_location="cpu", weights_only=True)
    assert saved.pop("mask_values") == [0, 1]
    assert saved.keys() == UNet(n_channels=3, n_classes=2, base_channels=8).state_dict().keys()
    assert Path(baseline["checkpoint"]).parent == work_dir / "runs" / "milesial-baseline"
    assert (work_dir / "logs" / "milesial-baseline-1.log").is_file(), "two pairs"

    # train.py's epoch: its split from the run's own phase records, and its fraction of the compute bound.
    split = result["split_s"]
    assert set(split) == {"startup", "steps", "validation", "checkpoint", "curves", "rest"}
    assert all(positive(split[k]) for k in ("startup", "steps", "validation", "checkpoint", "curves"))
    assert sum(split.values()) == pytest.approx(result["wall_s"])
    assert result["fraction_of_bound"] == pytest.approx(result["bound_s"] / result["wall_s"])
    assert positive(result["flops"]) and result["flops"] > result["train_flops"] > 0
    assert (work_dir / "runs" / "epoch-bf16" / "best.pth").is_file(), "a whole epoch: validated and saved"
    assert "\nepoch " in run.stdout and "FAILED" not in run.stdout
