"""Processes that die or hang: torchrun's elastic restart continues bit-exactly, and nobody waits forever.

Real processes on CPU with gloo: workers are found through /proc and killed or stopped with real signals.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import (
    TrainRunner,
    assert_same_training_state,
    finish,
    free_port,
    load_checkpoint,
    torchrun_prefix,
    wait_for_step,
    worker_pids,
)
from tests.helpers import one_error_line

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find worker processes"),
]

# 16 images, 25 % validation: 12 training images, 3 global batches of 2 x 2 per epoch. 30 planned epochs keep a run
# going long after any fault; the compared runs stop at STOP_AT (mid-epoch).
ARGS = ["-v", "25", "-e", "30", "--classes", "1", "--log-every", "1", "-b", "2"]
STOP_AT = 14


def wait_for_workers(launcher: subprocess.Popen, count: int, timeout_s: float = 120) -> dict[int, int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and launcher.poll() is None:
        pids = worker_pids(launcher.pid)
        if len(pids) == count:
            return pids
        time.sleep(0.05)
    out, err = finish(launcher, timeout=30)
    raise AssertionError(f"{count} workers did not start:\n{out}\n{err}")


def wait_for_step_checkpoint(path: Path, process: subprocess.Popen, timeout_s: float = 120) -> dict:
    """The first mid-epoch state that appears under ``path`` (a step checkpoint)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        if path.exists():
            payload = load_checkpoint(path)  # never partial: checkpoints are renamed into place
            if payload["step_in_epoch"]:
                return payload
        time.sleep(0.02)
    out, err = finish(process, timeout=30)
    raise AssertionError(f"no step checkpoint {path}:\n{out}\n{err}")


def manual_launch(runner: TrainRunner, exp_name: str, *extra: str) -> list[subprocess.Popen]:
    """Two `python train.py --ddp_mode --rank R --world-size 2 --dist-url tcp://...` processes, no launcher."""
    url = f"tcp://127.0.0.1:{free_port()}"
    return [
        runner.popen([sys.executable], exp_name, *ARGS, *extra, "--ddp_mode", "--rank", str(rank), "--world-size", "2",
                     "--dist-url", url)
        for rank in range(2)
    ]  # fmt: skip


def kill_rank_0_after_a_step_checkpoint(
    runner: TrainRunner, exp_name: str, max_steps: int, *extra: str
) -> tuple[dict, str, str]:
    """A torchrun run allowed one restart, with a step checkpoint every 2 steps, whose rank 0 gets SIGKILL after the
    first one; returns that checkpoint and the launcher's output, once it has ended with status 0."""
    launcher = runner.popen(
        [*torchrun_prefix(2), "--max-restarts=1"], exp_name, *ARGS, "--max-steps", str(max_steps), "--ddp_mode",
        "--save-every-steps", "2", *extra,
    )  # fmt: skip
    pids = wait_for_workers(launcher, 2)
    seen = wait_for_step_checkpoint(runner.run_dir(exp_name) / "last.pth", launcher)
    # Rank 0 is the one that writes: it may die in the middle of a checkpoint.
    os.kill(pids[0], signal.SIGKILL)
    out, err = finish(launcher)
    assert launcher.returncode == 0, out + err
    return seen, out, err


def test_torchrun_restarts_after_a_killed_worker_and_the_run_ends_bit_exact_in_the_attempts_folder(
    runner: TrainRunner,
) -> None:
    # Another experiment's checkpoint (one process, step 2) starts both runs with --resume PATH, and --ema: the average
    # (saved as the model) and the trained weights must both come back exactly.
    assert runner.main("donor", *ARGS, "--max-steps", "2", "--ema", "0.9") == 0
    donor = runner.run_dir("donor") / "last.pth"
    flags = ("--resume", str(donor), "--ema", "0.9")
    for process in manual_launch(runner, "reference", "--max-steps", str(STOP_AT), *flags):
        out, err = finish(process)
        assert process.returncode == 0, out + err

    # The same run under torchrun, allowed one restart, with a step checkpoint every 2 steps.
    run_dir = runner.run_dir("elastic")
    seen, out, err = kill_rank_0_after_a_step_checkpoint(runner, "elastic", STOP_AT, *flags)

    # torchrun restarted both workers. The restart has the same --resume on its command line, yet continues the
    # attempt's progress in its folder (resuming the donor again would throw that away), from the newest complete
    # checkpoint, at or after the one seen.
    resumed = [int(step) for step in re.findall(r"\[rank 0\] INFO Resuming at epoch \d+, step (\d+)", out)]
    assert len(resumed) == 2 and resumed[0] == 2, out + err
    assert seen["global_step"] <= resumed[1] < STOP_AT
    assert not runner.run_dir("elastic-2").exists()
    assert "live_model_state" in load_checkpoint(run_dir / "last.pth")  # --ema's two sets of weights
    assert_same_training_state(runner.run_dir("reference") / "last.pth", run_dir / "last.pth")
    assert not list(run_dir.glob(".*.tmp")), "the restart removes what a killed write left behind"


def test_a_dead_rank_outside_torchrun_ends_the_others_with_an_error(runner: TrainRunner) -> None:
    ranks = manual_launch(runner, "orphan", "--save-every-steps", "1", "--dist-timeout", "20")
    wait_for_step(runner.run_dir("orphan") / "metrics.jsonl", 2, ranks[0])
    ranks[1].kill()
    out, err = finish(ranks[0], timeout=120)
    finish(ranks[1])
    assert ranks[0].returncode == 1, out + err
    error = one_error_line(err)
    assert error.startswith("Error: lost contact with another training process") and "--resume auto" in error
    assert load_checkpoint(runner.run_dir("orphan") / "last.pth")["global_step"] >= 1


def test_a_hung_rank_ends_the_others_after_dist_timeout(runner: TrainRunner) -> None:
    ranks = manual_launch(runner, "hung", "--dist-timeout", "10")
    try:
        wait_for_step(runner.run_dir("hung") / "metrics.jsonl", 2, ranks[0])
        # A stopped process keeps its connections open: only the collective's timeout can end the wait.
        ranks[1].send_signal(signal.SIGSTOP)
        out, err = finish(ranks[0], timeout=120)
    finally:
        ranks[1].kill()
        finish(ranks[1])
    assert ranks[0].returncode == 1, out + err
    assert one_error_line(err).startswith("Error: lost contact with another training process")
