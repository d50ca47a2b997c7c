"""A real SLURM runs the project's sbatch examples: the job states and exit codes are SLURM's own (conftest.py)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO_ROOT, SyntheticData, child_env
from tests.slurm.conftest import Job, adapted_example, sbatch, train_args

pytestmark = pytest.mark.usefixtures("slurm")

TASKS = ["--ntasks-per-node=2"]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["model_state"]


def _global_steps(log: str) -> list[int]:
    return [int(step) for step in re.findall(r"\(global (\d+)\)", log)]


def test_srun_tasks_for_one_epoch_complete_whatever_signal_comes_at_shutdown(
    slurm_data: SyntheticData, tmp_path: Path
) -> None:
    script = adapted_example("srun_tasks.sbatch", tmp_path)
    job = sbatch(script, tmp_path, [*TASKS, "--job-name=one-epoch", "--time=10"],
                 train_args(slurm_data, tmp_path / "ck", "--epochs", "1"))  # fmt: skip
    deadline = time.monotonic() + 600
    while "Training complete" not in job.log():
        assert time.monotonic() < deadline and job.state() in {"PENDING", "RUNNING"}, job.log()[-3000:]
        time.sleep(0.05)
    # The time-limit signal landing while the tasks shut down (it used to end the job FAILED 138).
    sent = subprocess.run(["scancel", "--signal=USR1", job.job_id], capture_output=True, text=True, check=False)
    assert sent.returncode == 0, sent.stderr  # the job was still running: the signal reached its tasks
    fields = job.wait()
    log = job.log()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    assert "Training complete" in log and "\r" not in log
    assert (tmp_path / "ck" / "one-epoch" / "last.pth").is_file()


def _pending_usr1(pid: int) -> bool:
    """Whether SIGUSR1 waits in ``pid``'s pending sets (/proc/PID/status: SigPnd per thread, ShdPnd per process)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    masks = re.findall(r"^(?:SigPnd|ShdPnd):\s*([0-9a-f]+)$", status, flags=re.MULTILINE)
    return any(int(mask, 16) >> (signal.SIGUSR1 - 1) & 1 for mask in masks)


def test_time_limit_requeues_and_ends_completed_with_the_uninterrupted_weights(
    slurm_data: SyntheticData, tmp_path: Path
) -> None:
    script = adapted_example("srun_tasks.sbatch", tmp_path)
    args = train_args(slurm_data, tmp_path / "ck", "--epochs", "40")
    reference = sbatch(script, tmp_path, [*TASKS, "--job-name=reference", "--time=30"], args)
    # A 2-minute limit with the signal 60 s before it: SLURM sends it 60-90 s into a start of the job. A fast machine
    # trains the 40 epochs sooner, so the tasks are stopped (SIGSTOP) after their first checkpoint until SLURM's own
    # signal waits in them, then continued: the signal lands mid-training whatever the machine's speed.
    limited = sbatch(script, tmp_path, [*TASKS, "--job-name=limited", "--time=2", "--signal=USR1@60"], args)
    deadline = time.monotonic() + 600
    while "Saved last.pth" not in limited.log():
        assert time.monotonic() < deadline and limited.state() in {"PENDING", "RUNNING"}, limited.log()[-3000:]
        time.sleep(0.05)
    tasks = _torch_task_pids(limited)
    assert tasks, limited.log()[-3000:]
    for pid in tasks:
        os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 150
        while not any(_pending_usr1(pid) for pid in tasks) and "Requeued SLURM job" not in limited.log():
            assert time.monotonic() < deadline, f"SLURM sent no SIGUSR1 in 150 s:\n{limited.log()[-3000:]}"
            time.sleep(0.2)
    finally:
        for pid in tasks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    fields, reference_fields = limited.wait(), reference.wait()
    log = limited.log()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    assert (reference_fields["JobState"], reference_fields["ExitCode"]) == ("COMPLETED", "0:0")
    assert int(fields["Restarts"]) >= 1 and "Requeued SLURM job" in log, log[-3000:]
    steps = _global_steps(log)
    assert steps == list(range(1, len(steps) + 1)) and steps == _global_steps(reference.log())  # each once, in order
    limited_weights = _weights(tmp_path / "ck" / "limited" / "last.pth")
    reference_weights = _weights(tmp_path / "ck" / "reference" / "last.pth")
    assert all(torch.equal(tensor, reference_weights[key]) for key, tensor in limited_weights.items())


def test_scancel_then_a_resubmission_continues(slurm_data: SyntheticData, tmp_path: Path) -> None:
    script = adapted_example("srun_tasks.sbatch", tmp_path)
    args = train_args(slurm_data, tmp_path / "ck", "--epochs", "8")
    first = sbatch(script, tmp_path, [*TASKS, "--job-name=cancelled", "--time=10"], args)
    deadline = time.monotonic() + 600
    while "Saved last.pth" not in first.log() and first.state() in {"PENDING", "RUNNING"}:
        assert time.monotonic() < deadline, first.log()[-3000:]
        time.sleep(0.5)
    subprocess.run(["scancel", first.job_id], check=True)  # SIGTERM to every task
    assert first.wait(release_requeued=False)["JobState"] == "CANCELLED"
    assert (tmp_path / "ck" / "cancelled" / "INTERRUPTED.pth").is_file(), first.log()[-3000:]
    stopped_at = max(_global_steps(first.log()))
    second = sbatch(script, tmp_path, [*TASKS, "--job-name=cancelled", "--time=10"], args)
    fields = second.wait()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), second.log()[-3000:]
    assert min(_global_steps(second.log())) == stopped_at + 1, second.log()[-3000:]


def _torch_task_pids(job: Job) -> list[int]:
    """The job's processes that have loaded torch: its training tasks (and their DataLoader workers)."""
    listed = subprocess.run(["scontrol", "listpids", job.job_id], capture_output=True, text=True, check=False)
    pids = []
    for pid in re.findall(r"^(\d+)\s", listed.stdout, flags=re.MULTILINE):
        try:
            if "libtorch" in Path(f"/proc/{pid}/maps").read_text():
                pids.append(int(pid))
        except OSError:
            continue
    return pids


def test_the_requeue_signal_during_start_up_requeues(slurm_data: SyntheticData, tmp_path: Path) -> None:
    script = adapted_example("srun_tasks.sbatch", tmp_path)
    job = sbatch(script, tmp_path, [*TASKS, "--job-name=early", "--time=10"],
                 train_args(slurm_data, tmp_path / "ck", "--epochs", "2"))  # fmt: skip
    deadline = time.monotonic() + 600
    while not _torch_task_pids(job):
        assert time.monotonic() < deadline and job.state() in {"PENDING", "RUNNING"}, job.log()[-3000:]
        time.sleep(0.05)
    subprocess.run(["scancel", "--signal=USR1", job.job_id], check=True)  # to the tasks, as --signal=USR1@N does
    fields = job.wait()
    log = job.log()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    assert int(fields["Restarts"]) >= 1 and "Requeued SLURM job" in log, log[-3000:]


def _srun(*command: str) -> subprocess.CompletedProcess:
    env = child_env({"PATH": f"{REPO_ROOT / '.venv' / 'bin'}:/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    return subprocess.run(["srun", "--ntasks=2", "--cpus-per-task=1", "--time=5", *command], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)  # fmt: skip


def test_srun_tasks_without_ddp_mode_say_so_on_every_task(slurm_data: SyntheticData, tmp_path: Path) -> None:
    done = _srun("python", "train.py", *train_args(slurm_data, tmp_path / "ck", "--epochs", "1"))
    lines = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert done.returncode != 0 and len(lines) == 2, done.stderr[-3000:]
    assert all("without --ddp_mode" in line and "add --ddp_mode" in line for line in lines)
    assert not (tmp_path / "ck").exists()


def test_a_torchrun_per_task_says_so(slurm_data: SyntheticData, tmp_path: Path) -> None:
    args = train_args(slurm_data, tmp_path / "ck", "--epochs", "1", "--ddp_mode")
    done = _srun("torchrun", "--standalone", "--nproc_per_node=1", "train.py", *args)
    lines = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert done.returncode != 0 and len(lines) == 2, done.stderr[-3000:]
    assert all("each run torchrun" in line and "--ntasks-per-node=1" in line for line in lines)
