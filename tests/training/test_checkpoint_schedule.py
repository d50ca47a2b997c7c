"""--save-every-minutes (wall-time saves agreed across ranks) and --keep-best K (ranked best-<k>.pth files)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO_ROOT, TrainRunner, child_env, finish, load_checkpoint, torchrun_prefix
from tests.helpers import read_metrics
from utils.checkpoint.format import TrainPosition

FAKE_CLOCK = str(Path(__file__).with_name("fake_clock_train.py"))


def test_the_position_ranks_the_k_best() -> None:
    position = TrainPosition()

    def rank(dice: float, global_step: int, keep: int = 2) -> int | None:
        position.global_step = global_step
        return position.rank(dice, keep)

    assert rank(0.5, 1) == 1
    assert rank(0.7, 2) == 1
    assert rank(0.6, 3) == 2
    assert position.best_ranking == [[0.7, 2], [0.6, 3]]
    kept = position.best_ranking
    assert rank(0.6, 4) is None  # a tie ranks below the older state
    assert rank(0.65, 5) == 2 and position.best_ranking == [[0.7, 2], [0.65, 5]]
    assert kept == [[0.7, 2], [0.6, 3]]  # a new list: the old ranking is intact to put back
    assert rank(0.9, 6, keep=0) is None and position.best_ranking == [[0.7, 2], [0.65, 5]]  # --keep-best 0


@pytest.mark.slow
def test_minutes_and_keep_best_in_one_process(runner: TrainRunner) -> None:
    """Fake clock: 40 s per reading, --save-every-minutes 1 -> a time save every second step (6 steps per epoch)."""
    result = subprocess.run(
        [sys.executable, FAKE_CLOCK, *runner.args("timed", "-e", "3", "--save-every-minutes", "1", "--keep-best", "2",
                                                   "--save_every", "0", "--log-every", "100", "-v", "25")],
        cwd=REPO_ROOT, env=child_env({"FAKE_CLOCK_STEP_S": "40"}), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    log = result.stdout + result.stderr
    for step in (2, 4, 6):
        assert f"Saved last.pth at step {step} (0 epochs and {step} batches done)" in log
    assert "Saved last.pth at step 3 " not in log

    run_dir = runner.run_dir("timed")
    assert sorted(p.name for p in run_dir.glob("best*.pth")) == ["best-1.pth", "best-2.pth", "best.pth"]
    dice = {event["global_step"]: event["dice"] for event in read_metrics(run_dir, event="val")}
    # The two best validations, the older first on a tie.
    expected = sorted(dice, key=lambda step: (-dice[step], step))[:2]
    first, second = load_checkpoint(run_dir / "best-1.pth"), load_checkpoint(run_dir / "best-2.pth")
    assert [first["global_step"], second["global_step"]] == expected
    # The newest state knows the whole ranking (best-1.pth only the ranking of its time).
    assert load_checkpoint(run_dir / "last.pth")["best_ranking"] == [[dice[step], step] for step in expected]
    best = load_checkpoint(run_dir / "best.pth")
    assert all(torch.equal(tensor, first["model_state"][key]) for key, tensor in best["model_state"].items())
    assert "optimizer" not in first  # best-K.pth is weights-only; the run's flags are in the full-state files
    last_args = load_checkpoint(run_dir / "last.pth")["args"]
    assert last_args["keep_best"] == 2 and last_args["save_every_minutes"] == 1.0


@pytest.mark.slow
def test_minutes_are_agreed_across_two_ranks(runner: TrainRunner) -> None:
    """Rank 0 finds the save due at step 2; every rank learns it at step 3 and they save there together."""
    process = subprocess.Popen(
        [*torchrun_prefix(2), FAKE_CLOCK, *runner.args("timed_ddp", "--ddp_mode", "-e", "1",
                                                        "--save-every-minutes", "1", "--log-every", "100")],
        cwd=REPO_ROOT, env=child_env({"FAKE_CLOCK_STEP_S": "40"}), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    out, err = finish(process, timeout=600)
    assert process.returncode == 0, err
    assert "Saved last.pth at step 3 (0 epochs and 3 batches done)" in out + err
    assert "Saved last.pth at step 2 " not in out + err
