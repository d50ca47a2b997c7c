"""What a run says about itself at its start: the changed settings (log and config.yaml) and where a resume goes on."""

from __future__ import annotations

import pytest

from tests.conftest import SyntheticData, TrainRunner
from utils.training.run_log import ZERO_DICE_HINT


def train(runner: TrainRunner, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    """train.main in this process; what it printed (the log lines go to stdout)."""
    capsys.readouterr()
    assert runner.main("block", *extra) == 0
    return capsys.readouterr().out


def test_start_block_lists_changed_settings_and_resume_says_where_it_goes_on(
    carvana_data: SyntheticData, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    runner = TrainRunner(carvana_data, tmp_path / "checkpoints")
    # 16 images, 25 % validation, batch 4: 3 steps per epoch; --max-steps 3 stops after epoch 1 of 1..2.
    changed = ["--ema", "0.9", "--deep-supervision", "--scheduler", "poly", "--warmup-steps", "2"]
    plan = ["-v", "25", "-e", "2", "-b", "4", "--classes", "1", "--no-progress"]
    out = train(runner, capsys, *plan, *changed, "--max-steps", "3")
    assert "Starting training: epochs 1..2, batch size 4" in out
    block = out[out.index("Settings that differ from the defaults:") :].split("\n\n")[0]
    for line in ("  --ema 0.9", "  --deep-supervision", "  --scheduler poly", "  --warmup-steps 2", "  --epochs 2"):
        assert line + "\n" in block, block
    assert "--encoder " not in block and "--optimizer" not in block  # defaults are not listed
    config_yaml = (runner.run_dir("block") / "config.yaml").read_text()
    assert "#   --deep-supervision\n" in config_yaml and "#   --scheduler poly\n" in config_yaml

    out = train(runner, capsys, *plan, *changed, "--resume", "auto")
    # --max-steps stopped the first run after the 3 batches of epoch 1, before that epoch's end was recorded.
    assert "Resuming at epoch 1, step 3 (3 batches of the epoch done) of epochs 1..2, batch size 4" in out, out
    assert "Starting training" not in out
    # This tiny run's validations score Dice 0 (it predicts no car yet): one hint says that is expected early.
    assert out.count("Dice 0.0000,") >= 2 and out.count(ZERO_DICE_HINT) == 1, out
