"""One message per job under torchrun: errors and warnings every rank would print come from global rank 0 only (and
so do TensorBoard's events).

Real 2-process torchrun launches on CPU (gloo), with stdout and stderr in one stream as a terminal shows them.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, TrainRunner, child_env, torchrun_prefix
from tests.helpers import (
    names_rank_0_with_status_2,
    read_metrics,
    tensorboard_reader,
    tensorboard_scalars,
    torchrun_root_cause,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchrun on CPU, tested on Linux"),
]


def run_torchrun(runner: TrainRunner, exp_name: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*torchrun_prefix(2), "train.py", *runner.args(exp_name, *extra)],
        cwd=REPO_ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("Error: ")]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # Found while parsing the flags, before the processes meet: every rank has the same flags.
        (["--ddp_mode", "--scale", "0"], "Error: --scale must be a finite number in (0, 1], got 0"),
        # Found while building the run, agreed on by the ranks (the data is checked on every rank).
        (["-b", "64"], "Error: --batch-size 64 is larger than the 8 training images each of the 2 process(es) gets"),
    ],
)
def test_a_user_error_is_printed_once_and_torchrun_names_rank_0_as_the_root_cause(
    runner: TrainRunner, extra: list[str], message: str
) -> None:
    result = run_torchrun(runner, "error", *extra)
    assert result.returncode != 0
    output = result.stdout
    assert len(error_lines(output)) == 1, output
    assert error_lines(output)[0].startswith(message), output
    # The Error line comes before torchrun's own report, whose root cause is rank 0 with the user-error status 2.
    assert output.index("Error: ") < output.index("ChildFailedError")
    cause = torchrun_root_cause(output)
    assert names_rank_0_with_status_2(cause), cause
    assert "[rank 1]" not in output, output
    # The waiting rank ends on torchrun's SIGTERM; it used to sleep on until torchrun killed it 30 s later.
    assert "Unable to shutdown process" not in output, output  # torchrun: "... via 15, forcefully exiting via 9"


def test_a_ddp_run_warns_logs_and_writes_tensorboard_events_from_rank_0_only(runner: TrainRunner) -> None:
    # Without --ddp_mode: the warning that DDP was switched on is the same on both ranks and printed by rank 0 only.
    # One launch checked for two things global rank 0 alone does: the messages, and TensorBoard's events.
    result = run_torchrun(runner, "ddp", "-e", "1", "--log-every", "1", "--tensorboard")
    output = result.stdout
    assert result.returncode == 0, output
    assert output.count("DDP switched on") == 1 and "[rank 0] WARNING launched as 2 processes" in output, output
    assert "[rank 1]" not in output and not error_lines(output), output
    # Output to a pipe: log lines, no bars. 15 training images on 2 ranks, batch 2: the sampler pads the epoch to 16,
    # 4 steps of 2 x 2 images, each logged once (by rank 0).
    assert "\r" not in output
    steps = re.findall(r"epoch 1/1 step (\d+)/(\d+) \(global \d+\)", output)
    assert steps == [(str(k), "4") for k in range(1, 5)], steps
    assert output.count("epoch 1/1 done (step 4)") == 1, output
    # One event file (rank 1 writes none), holding each logged step once.
    run_dir = runner.run_dir("ddp")
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    logged = [step for step, _ in tensorboard_scalars(tensorboard_reader(run_dir), "train/loss")]
    assert logged == [event["global_step"] for event in read_metrics(run_dir, event="train")] == [1, 2, 3, 4]


def test_help_under_torchrun_is_printed_once(runner: TrainRunner) -> None:
    result = run_torchrun(runner, "help", "--help")
    assert result.returncode == 0, result.stdout
    assert result.stdout.count("usage: train.py") == 1, result.stdout
