"""The demo data is learnable: a short training run on it lowers the loss and finds the cars."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import SyntheticData, TrainRunner
from tests.helpers import read_metrics

pytestmark = pytest.mark.slow  # ten epochs of training (see the markers in pyproject.toml)


def test_a_few_epochs_on_demo_data_lower_the_loss(carvana_data: SyntheticData, tmp_path: Path) -> None:
    runner = TrainRunner(carvana_data, tmp_path / "checkpoints")
    status = runner.main(
        "learn",
        "--epochs",
        "10",
        "--learning-rate",
        "3e-3",
        "--validation",
        "25",
        "--log-every",
        "1",
        "--save_every",
        "10",
    )
    assert status == 0
    losses = [r["loss"] for r in read_metrics(runner.run_dir("learn"), event="train")]
    dice = [r["dice"] for r in read_metrics(runner.run_dir("learn"), event="val")]
    assert len(losses) == 10 * 6  # 12 training images, batch 2
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.75 * first, (first, last)
    # An untrained model predicts no car (Dice 0) or everywhere (about 0.5); learning moves well past both.
    assert dice[-1] > 0.8, dice
