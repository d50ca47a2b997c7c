"""curves.png from a real train.py process (headless) and its resume: drawn at the end of each, one continuous curve
after resume."""

from __future__ import annotations

import sys

import pytest
from PIL import Image

from tests.conftest import TrainRunner, finish, load_checkpoint
from utils.training.curves import read_series

pytestmark = pytest.mark.slow  # a real train.py process, then its resume (see the markers in pyproject.toml)


def test_a_stopped_and_resumed_run_draws_one_continuous_curve_without_a_display(runner: TrainRunner) -> None:
    # No display and no backend choice: the curves must not need either.
    headless = {"DISPLAY": "", "MPLBACKEND": ""}
    common = ("--epochs", "2", "--log-every", "1")
    first = runner.popen([sys.executable], "curves", *common, "--max-steps", "9", env=headless)
    _, first_err = finish(first)
    assert first.returncode == 0, first_err
    run_dir = runner.run_dir("curves")
    # --max-steps 9 stops in epoch 2, after epoch 1 was validated once.
    assert len(read_series(run_dir / "metrics.jsonl").dice) == 1
    # The resume in this process: the first run drew headless in a fresh interpreter already (curves.png is drawn on
    # matplotlib's Agg canvas, with no backend to choose), and a second interpreter start costs seconds.
    assert runner.main("curves", *common, "--resume", "auto") == 0

    series = read_series(run_dir / "metrics.jsonl")
    last_step = load_checkpoint(run_dir / "last.pth")["global_step"]
    # Every step once, in order, across the stop: one continuous curve (the resumed run re-logs no step twice).
    assert [step for step, _ in series.loss] == list(range(1, last_step + 1)) and last_step > 9
    assert len(series.dice) == 2 and series.dice[-1][0] == last_step
    assert [epoch for epoch, _ in series.epoch_seconds] == [1, 2]
    with Image.open(run_dir / "curves.png") as image:
        assert image.format == "PNG" and image.size[0] > 800
