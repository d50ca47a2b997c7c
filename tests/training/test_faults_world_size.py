"""Resuming with fewer processes (4 -> 2 under torchrun, 2 -> 1): from step and epoch checkpoints, same data position.

16 images with 25 % validation leave 12 training images. The position inside an epoch is stored as batches of the
saving run, i.e. a number of images of the epoch's order; a run with another world size skips exactly those images,
which shows in the number of steps it needs to finish the epoch.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import TrainRunner, finish, load_checkpoint, torchrun_prefix

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchrun with gloo on Linux"),
]

ARGS = ["-v", "25", "--classes", "1", "-b", "1", "-e", "3"]


def run_to_completion(process: subprocess.Popen, timeout: float = 300) -> str:
    out, err = finish(process, timeout=timeout)
    assert process.returncode == 0, out + err
    return out + err


def position(payload: dict) -> tuple[int, int, int, int]:
    return payload["world_size"], payload["epoch"], payload["step_in_epoch"], payload["global_step"]


def test_resume_with_fewer_processes_from_step_and_epoch_checkpoints(
    runner: TrainRunner, caplog: pytest.LogCaptureFixture
) -> None:
    # 4 processes x 1 image: 3 steps per epoch. Epoch 1, then 1 step (4 images) of epoch 2.
    four = runner.run_dir("four")
    run_to_completion(runner.popen(torchrun_prefix(4), "four", *ARGS, "--ddp_mode", "--max-steps", "4"))
    assert position(load_checkpoint(four / "checkpoint_epoch1.pth")) == (4, 1, 0, 3)
    assert position(load_checkpoint(four / "last.pth")) == (4, 1, 1, 4)

    # 4 -> 2 from the step checkpoint: 8 images of epoch 2 are left, 4 steps of 2 images; then 2 steps of epoch 3.
    output = run_to_completion(
        runner.popen(torchrun_prefix(2), "four", *ARGS, "--ddp_mode", "--max-steps", "10", "--resume", "auto")
    )
    assert "effective batch size changes from 4 (4 process(es) x --batch-size 1 x --grad-accum 1)" in output
    assert "to 2 (2 x 1 x 1)" in output and "(4 of this epoch done)" in output
    assert position(load_checkpoint(four / "checkpoint_epoch2.pth")) == (2, 2, 0, 8)
    assert position(load_checkpoint(four / "last.pth")) == (2, 2, 2, 10)

    # 2 -> 1 from the epoch checkpoint: all 12 images of epoch 3, one per step.
    assert runner.main("from_epoch", *ARGS, "--resume", str(four / "checkpoint_epoch2.pth")) == 0
    assert position(load_checkpoint(runner.run_dir("from_epoch") / "last.pth")) == (1, 3, 0, 20)
    assert "effective batch size changes from 2" in caplog.text and "to 1 (1 x 1 x 1)" in caplog.text

    # 2 -> 1 from the step checkpoint: 4 images of epoch 3 done by 2 processes, 8 left.
    caplog.clear()
    assert runner.main("from_step", *ARGS, "--resume", str(four / "last.pth")) == 0
    assert position(load_checkpoint(runner.run_dir("from_step") / "last.pth")) == (1, 3, 0, 18)
    assert "(4 of this epoch done)" in caplog.text
