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
                 train_args(slurm_data, tmp_path / "ck", "--epochs", "1"), what="srun tasks, one epoch")  # fmt: skip
    deadline = time.monotonic() + 600
    while "(global 1)" not in job.log():  # training: the tasks are known before they shut down
        assert time.monotonic() < deadline and job.state() in {"PENDING", "RUNNING"}, job.log()[-3000:]
        time.sleep(0.05)
    tasks = _torch_task_pids(job)
    while "Training complete" not in job.log():
        assert time.monotonic() < deadline and job.state() in {"PENDING", "RUNNING"}, job.log()[-3000:]
        time.sleep(0.01)
    # The time-limit signal, and scancel's SIGTERM, landing while the tasks shut down (it used to end the job FAILED
    # 138). First while they are held (SIGSTOP, at once), so that both reach them whatever the machine's speed, then
    # again and again, in turn, until the tasks are gone.
    ended = time.monotonic()
    sent_while_alive = 0
    for pid in tasks:
        os.kill(pid, signal.SIGSTOP)
    try:
        for name in ("USR1", "TERM"):
            sent = subprocess.run(["scancel", f"--signal={name}", job.job_id], capture_output=True, text=True)
            assert sent.returncode == 0 and tasks, (tasks, sent.stderr)  # the step and its tasks were there
            sent_while_alive += 1
        time.sleep(2)  # slurmd delivers the signals after scancel returns
    finally:
        for pid in tasks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    while tasks := _torch_task_pids(job):
        assert time.monotonic() < deadline, f"the tasks were still there after 10 minutes:\n{job.log()[-3000:]}"
        name = ("USR1", "TERM")[sent_while_alive % 2]
        sent = subprocess.run(["scancel", f"--signal={name}", job.job_id], capture_output=True, check=False)
        if sent.returncode != 0:  # the step is over
            break
        sent_while_alive += any(Path(f"/proc/{pid}").exists() for pid in tasks)
        time.sleep(0.1)
    shutdown_s = time.monotonic() - ended
    fields = job.wait()
    log = job.log()
    print(f"    {sent_while_alive} signals (SIGUSR1, SIGTERM in turn) sent to the tasks while they shut down; they "
          f"were gone {shutdown_s - 2:.1f} s after 'Training complete' (not counting the 2 s held)")  # fmt: skip
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
    reference = sbatch(script, tmp_path, [*TASKS, "--job-name=reference", "--time=30"], args,
                       what="uninterrupted reference")  # fmt: skip
    # A 3-minute limit with the signal 60 s before it: SLURM sends it 90-120 s into a start of the job. A fast machine
    # trains the 40 epochs sooner, so the tasks are stopped (SIGSTOP) after their first checkpoint until SLURM's own
    # signal waits in them, then continued: the signal lands mid-training whatever the machine's speed.
    limited = sbatch(script, tmp_path, [*TASKS, "--job-name=limited", "--time=3", "--signal=USR1@60"], args,
                     what="--time=3 --signal=USR1@60")  # fmt: skip
    deadline = time.monotonic() + 600
    while "Saved last.pth" not in limited.log():
        assert time.monotonic() < deadline and limited.state() in {"PENDING", "RUNNING"}, limited.log()[-3000:]
        time.sleep(0.05)
    tasks = _torch_task_pids(limited)
    assert tasks, limited.log()[-3000:]
    for pid in tasks:
        os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 210
        while not any(_pending_usr1(pid) for pid in tasks) and "Requeued SLURM job" not in limited.log():
            assert time.monotonic() < deadline, f"SLURM sent no SIGUSR1 in 210 s:\n{limited.log()[-3000:]}"
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
    first = sbatch(script, tmp_path, [*TASKS, "--job-name=cancelled", "--time=10"], args, what="scancel")
    deadline = time.monotonic() + 600
    while "Saved last.pth" not in first.log() and first.state() in {"PENDING", "RUNNING"}:
        assert time.monotonic() < deadline, first.log()[-3000:]
        time.sleep(0.5)
    subprocess.run(["scancel", first.job_id], check=True)  # SIGTERM to every task
    assert first.wait(release_requeued=False)["JobState"] == "CANCELLED"
    assert (tmp_path / "ck" / "cancelled" / "INTERRUPTED.pth").is_file(), first.log()[-3000:]
    stopped_at = max(_global_steps(first.log()))
    second = sbatch(script, tmp_path, [*TASKS, "--job-name=cancelled", "--time=10"], args, what="resubmission")
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


START_UP_MOMENTS = {
    "imports": "SIGUSR1 while torch is imported; SLURM's own hold after the requeue",
    "set-up": "SIGUSR1 at 'Creating dataset'",
}


@pytest.mark.parametrize("moment", START_UP_MOMENTS)
def test_the_requeue_signal_during_start_up_requeues(slurm_data: SyntheticData, tmp_path: Path, moment: str) -> None:
    script = adapted_example("srun_tasks.sbatch", tmp_path)
    job = sbatch(script, tmp_path, [*TASKS, "--job-name=early", "--time=10"],
                 train_args(slurm_data, tmp_path / "ck", "--epochs", "2"), what=START_UP_MOMENTS[moment])  # fmt: skip
    deadline = time.monotonic() + 600
    while not (_torch_task_pids(job) if moment == "imports" else "Creating dataset" in job.log()):
        assert time.monotonic() < deadline and job.state() in {"PENDING", "RUNNING"}, job.log()[-3000:]
        time.sleep(0.05)
    subprocess.run(["scancel", "--signal=USR1", job.job_id], check=True)  # to the tasks, as --signal=USR1@N does
    fields = job.wait(release_requeued=moment != "imports")  # one job shows the pending time the docs give
    log = job.log()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    assert int(fields["Restarts"]) >= 1 and "Requeued SLURM job" in log, log[-3000:]
    assert "Stopped by SIGUSR1 at epoch 1, step 1;" in log, log[-3000:]  # remembered, acted on at the first step
    steps = _global_steps(log)
    assert steps == list(range(1, len(steps) + 1)), log[-3000:]


def test_the_torchrun_example_requeues_on_the_requeue_signal(slurm_data: SyntheticData, tmp_path: Path) -> None:
    script = adapted_example("srun_torchrun.sbatch", tmp_path)
    job = sbatch(script, tmp_path, ["--job-name=torchrun", "--time=10", "--cpus-per-task=2"],
                 train_args(slurm_data, tmp_path / "ck", "--epochs", "10"),
                 what="srun torchrun, SIGUSR1 mid-training")  # fmt: skip
    deadline = time.monotonic() + 600
    while "Saved last.pth" not in job.log():
        assert time.monotonic() < deadline and job.state() in {"PENDING", "RUNNING"}, job.log()[-3000:]
        time.sleep(0.05)
    subprocess.run(["scancel", "--signal=USR1", job.job_id], check=True)  # as --signal=USR1@N does
    fields = job.wait()
    log = job.log()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    assert int(fields["Restarts"]) >= 1 and "Requeued SLURM job" in log, log[-3000:]
    assert "Training complete" in log, log[-3000:]
    steps = _global_steps(log)
    assert steps == list(range(1, len(steps) + 1)), log[-3000:]  # each once: torchrun restarted nothing


def test_an_array_task_requeues_itself_alone(slurm_data: SyntheticData, tmp_path: Path) -> None:
    # Each task its own run folder, as docs/CLUSTERS.md says for array jobs.
    script = adapted_example("srun_tasks.sbatch", tmp_path,
                             {'"$SLURM_JOB_NAME"': '"${SLURM_JOB_NAME}_${SLURM_ARRAY_TASK_ID}"'})  # fmt: skip
    args = train_args(slurm_data, tmp_path / "ck", "--epochs", "10")
    array = sbatch(script, tmp_path, [*TASKS, "--job-name=array", "--time=10", "--array=0-1"], args, what="array",
                   output="job-%A_%a.out")  # fmt: skip
    untouched, signalled = array.array_task(0, "array task 0"), array.array_task(1, "array task 1, SIGUSR1")
    deadline = time.monotonic() + 600
    while "Saved last.pth" not in signalled.log():
        assert time.monotonic() < deadline and signalled.state() in {"PENDING", "RUNNING"}, signalled.log()[-3000:]
        time.sleep(0.05)
    subprocess.run(["scancel", "--signal=USR1", signalled.job_id], check=True)
    fields, untouched_fields = signalled.wait(), untouched.wait()
    log = signalled.log()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    assert f"Requeued SLURM job {signalled.job_id} " in log and int(fields["Restarts"]) >= 1, log[-3000:]
    assert (untouched_fields["JobState"], untouched_fields["ExitCode"]) == ("COMPLETED", "0:0")
    assert untouched_fields["Restarts"] == "0" and "Requeued" not in untouched.log(), untouched.log()[-3000:]


def _srun(*command: str) -> subprocess.CompletedProcess:
    env = child_env({"PATH": f"{REPO_ROOT / '.venv' / 'bin'}:/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    return subprocess.run(["srun", "--ntasks=2", "--cpus-per-task=1", "--time=5", *command], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)  # fmt: skip


def _error_lines(what: str, done: subprocess.CompletedProcess) -> list[str]:
    lines = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    print(f"srun --ntasks=2 {what}: exit {done.returncode}, {len(lines)} Error lines"
          + "".join(f"\n    {line[:160]}" for line in dict.fromkeys(lines)))  # fmt: skip
    return lines


def test_srun_tasks_without_ddp_mode_say_so_on_every_task(slurm_data: SyntheticData, tmp_path: Path) -> None:
    done = _srun("python", "train.py", *train_args(slurm_data, tmp_path / "ck", "--epochs", "1"))
    lines = _error_lines("python train.py (no --ddp_mode)", done)
    assert done.returncode != 0 and len(lines) == 2, done.stderr[-3000:]
    assert all("without --ddp_mode" in line and "add --ddp_mode" in line for line in lines)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("rendezvous", [[], ["--standalone"]], ids=["default", "standalone"])
def test_a_torchrun_per_task_says_so(slurm_data: SyntheticData, tmp_path: Path, rendezvous: list[str]) -> None:
    args = train_args(slurm_data, tmp_path / "ck", "--epochs", "1", "--ddp_mode")
    done = _srun("torchrun", *rendezvous, "--nproc_per_node=1", "train.py", *args)
    lines = _error_lines(f"torchrun {' '.join(rendezvous)} --nproc_per_node=1 train.py --ddp_mode", done)
    assert done.returncode != 0 and len(lines) == 2, done.stderr[-3000:]
    assert all("each run torchrun" in line and "--ntasks-per-node=1" in line for line in lines)
    assert not (tmp_path / "ck").exists()
