"""A real SIGINT to a real training process: INTERRUPTED.pth, exit status 130, and a bit-exact resume."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from tests.conftest import TrainRunner, assert_same_training_state, load_checkpoint, wait_for_step

pytestmark = pytest.mark.slow  # real train.py processes, stopped and resumed (see the markers in pyproject.toml)

# Long enough (30 epochs of 8 steps) that the signal always lands mid-run; both runs end at step 16.
EPOCHS = ["-e", "30"]
STOP_AT = "16"


def test_sigint_saves_stops_and_resumes_bit_exactly(runner: TrainRunner) -> None:
    assert runner.main("reference", *EPOCHS, "--max-steps", STOP_AT) == 0

    process = runner.popen([sys.executable], "interrupted", *EPOCHS, "--log-every", "1")
    run_dir = runner.run_dir("interrupted")
    wait_for_step(run_dir / "metrics.jsonl", 2, process)
    os.kill(process.pid, signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "Stopped by SIGINT" in out and "--resume auto" in out
    interrupted = load_checkpoint(run_dir / "INTERRUPTED.pth")
    assert 2 <= interrupted["global_step"] < int(STOP_AT)
    assert interrupted["epoch"] * 8 + interrupted["step_in_epoch"] == interrupted["global_step"]
    assert not list(run_dir.glob(".*.tmp")), "no half-written checkpoint may remain"

    # --resume auto picks INTERRUPTED.pth (the newest complete checkpoint) and continues exactly.
    assert runner.main("interrupted", *EPOCHS, "--max-steps", STOP_AT, "--resume", "auto") == 0
    assert_same_training_state(runner.run_dir("reference") / "last.pth", run_dir / "last.pth")
