"""Requeue at the time limit, with real processes started as ``srun`` starts them (SLURM variables set here, two
tasks on 127.0.0.1) and a fake ``scontrol`` on PATH that records its arguments."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import (
    REPO_ROOT,
    TrainRunner,
    assert_same_training_state,
    child_env,
    finish,
    free_port,
    load_checkpoint,
    wait_for_step,
)
from tests.helpers import fake_scontrol
from utils.launch.environments import LaunchPlan
from utils.launch.signals import requeue_if_asked

JOB_ID = "777123"
EPOCHS = ["-e", "30"]  # 30 epochs of 4 steps (16 images, 2 ranks of batch 2): the signal always lands mid-run
STOP_AT = "12"


def srun_tasks(runner: TrainRunner, exp_name: str, *extra: str, path_prefix: Path, ntasks: int = 2):
    """``srun --ntasks=N python train.py --ddp_mode ...``: N processes with the variables srun gives its tasks."""
    port = str(free_port())
    processes = []
    for rank in range(ntasks):
        env = child_env(
            {
                "SLURM_JOB_ID": JOB_ID,
                "SLURM_PROCID": str(rank),
                "SLURM_NTASKS": str(ntasks),
                "SLURM_LOCALID": str(rank),
                "SLURM_JOB_NODELIST": "127.0.0.1",
                "SLURM_STEP_TASKS_PER_NODE": str(ntasks),
                "MASTER_PORT": port,
                "PATH": f"{path_prefix}{os.pathsep}{os.environ['PATH']}",
            }
        )
        processes.append(
            subprocess.Popen(
                [sys.executable, "train.py", "--ddp_mode", *runner.args(exp_name, *extra)],
                cwd=REPO_ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return processes


def finish_all(processes: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    results = []
    for process in processes:
        out, err = finish(process)
        results.append((process.returncode, out, err))
    return results


@pytest.mark.slow
def test_usr1_saves_requeues_once_and_the_requeued_job_resumes_bit_exactly(runner: TrainRunner, tmp_path: Path):
    calls = fake_scontrol(tmp_path / "bin")
    reference = finish_all(srun_tasks(runner, "reference", *EPOCHS, "--max-steps", STOP_AT, path_prefix=tmp_path))
    assert [code for code, _, _ in reference] == [0, 0], reference

    processes = srun_tasks(runner, "job", *EPOCHS, "--log-every", "1", path_prefix=tmp_path / "bin")
    run_dir = runner.run_dir("job")
    wait_for_step(run_dir / "metrics.jsonl", 2, processes[0])
    for process in processes:  # SLURM signals every task of the step
        os.kill(process.pid, signal.SIGUSR1)
    results = finish_all(processes)
    assert [code for code, _, _ in results] == [128 + signal.SIGUSR1] * 2, results
    assert calls.read_text().splitlines() == [f"requeue {JOB_ID}"], "exactly one requeue, by rank 0, naming the job"
    assert "Requeued SLURM job" in results[0][2] + results[0][1]
    interrupted = load_checkpoint(run_dir / "INTERRUPTED.pth")
    assert 2 <= interrupted["global_step"] < int(STOP_AT)
    assert interrupted["epoch"] * 4 + interrupted["step_in_epoch"] == interrupted["global_step"]

    # The requeued job runs the same script: --resume auto continues from INTERRUPTED.pth, bit-exactly.
    resumed = srun_tasks(runner, "job", *EPOCHS, "--max-steps", STOP_AT, "--resume", "auto", path_prefix=tmp_path)
    resumed_results = finish_all(resumed)
    assert [code for code, _, _ in resumed_results] == [0, 0], resumed_results
    assert_same_training_state(runner.run_dir("reference") / "last.pth", run_dir / "last.pth")
    assert calls.read_text().splitlines() == [f"requeue {JOB_ID}"], "a run that ends normally requeues nothing"


@pytest.mark.parametrize("exit_status", [1, None])
def test_a_failing_or_missing_scontrol_is_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, exit_status: int | None
) -> None:
    folder = tmp_path / "bin"
    folder.mkdir()
    if exit_status is not None:
        fake_scontrol(folder, exit_status=exit_status)
    monkeypatch.setenv("PATH", str(folder))  # no scontrol anywhere else
    with caplog.at_level(logging.WARNING):
        plan = LaunchPlan(slurm_job_id=JOB_ID, requeue_signal=signal.SIGUSR1)
        assert requeue_if_asked(plan, signal.SIGUSR1) is False
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert f"Could not requeue SLURM job {JOB_ID}" in warnings[0].getMessage()
    assert "--resume auto" in warnings[0].getMessage()
