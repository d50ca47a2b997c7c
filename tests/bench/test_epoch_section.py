"""The epoch section's pure parts: the wall-time split from phase records, the run-log check, forward FLOPs.

The section itself runs (a real train.py epoch) in tests/bench/test_benchmark.py's quick run.
"""

from __future__ import annotations

import pytest
from torch import nn

from scripts.bench.epoch import split_wall_time
from scripts.bench.flops import inference_flops_per_image
from scripts.bench.processes import MeasurementError
from scripts.bench.run_log import check_precision, run_summary

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
