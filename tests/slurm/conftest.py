"""The real-SLURM tier: a single-node SLURM on this machine (``scripts/slurm_cluster.sh``), the project's sbatch
examples submitted to it, and the job states and exit codes SLURM itself records.

Runs only when asked (``UNET_DDP_SLURM_TESTS=1``, as ``.ci/run`` does as root): it installs packages and starts
daemons. Every test skips with one line otherwise.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, SyntheticData, child_env, free_port

ENABLE_VARIABLE = "UNET_DDP_SLURM_TESTS"
JOB_TIMEOUT_S = 900.0  # a bound for a hung job, not a measurement: the jobs take seconds to a few minutes
FINISHED_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(ENABLE_VARIABLE) == "1":
        return
    skip = pytest.mark.skip(reason=f"real-SLURM tier: set {ENABLE_VARIABLE}=1 as root (.ci/run does)")
    for item in items:
        if Path(__file__).parent in Path(item.fspath).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def slurm() -> Iterator[None]:
    """Install (if needed) and start the single-node cluster, stopped again at the end; skip with one line where it
    cannot be (not root, no package registry)."""
    if os.geteuid() != 0:
        pytest.skip("real-SLURM tier: needs root to install and start SLURM")
    started = subprocess.run(["bash", "scripts/slurm_cluster.sh", "start"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=600, check=False)  # fmt: skip
    if started.returncode != 0:
        last = (started.stderr.strip().splitlines() or ["no message"])[-1]
        pytest.skip(f"real-SLURM tier: scripts/slurm_cluster.sh start failed: {last[-300:]}")
    yield
    subprocess.run(["bash", "scripts/slurm_cluster.sh", "stop"], cwd=REPO_ROOT, timeout=120, check=False)


@pytest.fixture(scope="session")
def slurm_data(tmp_path_factory: pytest.TempPathFactory) -> SyntheticData:
    """Larger images than the other tiers': a run must outlast SLURM's time-limit signal (tens of seconds)."""
    from utils.datasets.synthetic import generate_carvana_like

    root = tmp_path_factory.mktemp("slurm-carvana")
    generate_carvana_like(root, 16, size=(160, 112), seed=0)
    return SyntheticData(root / "imgs", root / "masks", 16)


@dataclass
class Job:
    job_id: str
    output: Path
    what: str = ""
    """What the job is, in its line of the tier's output."""

    def fields(self) -> dict[str, str]:
        shown = subprocess.run(["scontrol", "show", "job", "-o", self.job_id], capture_output=True, text=True,
                               check=True).stdout  # fmt: skip
        return dict(re.findall(r"(\w+)=(\S*)", shown))

    def state(self) -> str:
        return self.fields()["JobState"]

    def wait(self, *, release_requeued: bool = True) -> dict[str, str]:
        """Poll until the job finished; a requeued job waits ~2 minutes (BeginTime) unless released at once. Prints
        one line per job (pytest -rP): its final state and the states it went through, each with its seconds."""
        deadline = time.monotonic() + JOB_TIMEOUT_S
        states: list[tuple[str, float, float | None]] = []  # state(reason), first seen, SLURM's BeginTime hold
        while time.monotonic() < deadline:
            fields = self.fields()
            reason = fields.get("Reason", "None")
            shown = fields["JobState"] + ("" if reason == "None" else f"({reason})")
            if not states or states[-1][0] != shown:
                states.append((shown, time.monotonic(), _begin_hold_s(fields) if reason == "BeginTime" else None))
            if fields["JobState"] in FINISHED_STATES:
                print(self._summary(fields, states))
                return fields
            if release_requeued and fields["JobState"] == "PENDING" and reason == "BeginTime":
                subprocess.run(["scontrol", "update", f"jobid={self.job_id}", "StartTime=now"], check=False)
            time.sleep(1)
        raise AssertionError(f"job {self.job_id} still {self.state()} after {JOB_TIMEOUT_S} s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return self.output.read_text() if self.output.exists() else ""

    def array_task(self, index: int, what: str) -> Job:
        """Task ``index`` of this array job, submitted with the output job-%A_%a.out."""
        task = f"{self.job_id}_{index}"
        return Job(task, self.output.with_name(f"job-{task}.out"), what)

    def _summary(self, fields: dict[str, str], states: list[tuple[str, float, float | None]]) -> str:
        went = []
        for (state, since, hold), following in zip(states, [*states[1:], None], strict=True):
            seconds = "" if following is None else f" {following[1] - since:.0f}s"
            went.append(state + seconds + ("" if hold is None else f" [SLURM's hold: {hold:.0f}s]"))
        lines = self.log().splitlines()
        key = [line[line.index(marker) :] for line in lines for marker in KEY_LOG_LINES if marker in line]
        return (f"SLURM job {self.job_id} ({self.what}): {fields['JobState']} {fields.get('ExitCode')} "
                f"Restarts={fields.get('Restarts')} RunTime={fields.get('RunTime')}; states: {' > '.join(went)}"
                + "".join(f"\n    log: {line[:120]}" for line in dict.fromkeys(key)))  # fmt: skip


KEY_LOG_LINES = ("Stopped by", "Requeued SLURM job", "Resuming from", "Training complete", "srun: error", "Error:")
"""The log lines quoted under a job's line in the tier's output (each distinct one once)."""


def _begin_hold_s(fields: dict[str, str]) -> float | None:
    """How long SLURM holds a requeued job: its StartTime (the begin time it set) from now, in seconds."""
    try:
        return (datetime.datetime.fromisoformat(fields["StartTime"]) - datetime.datetime.now()).total_seconds()
    except (KeyError, ValueError):
        return None


def adapted_example(name: str, folder: Path, replace: dict[str, str] | None = None) -> Path:
    """``scripts/slurm/NAME`` for this machine: no GPUs requested, no --amp, 2 torchrun workers instead of 8 (CPUs),
    a free port for torchrun's rendezvous (other work on the machine may hold 29500), and ``replace``'s changes
    (old text: new text); everything else as shipped."""
    text = (REPO_ROOT / "scripts" / "slurm" / name).read_text()
    changes = {" --amp": "", "--nproc_per_node=8": "--nproc_per_node=2", ":29500": f":{free_port()}", **(replace or {})}
    for old, new in changes.items():
        text = text.replace(old, new)
    kept = [line for line in text.splitlines() if "--gpus-per-node" not in line]
    script = folder / name
    script.write_text("\n".join(kept) + "\n")
    return script


def sbatch(
    script: Path, folder: Path, options: list[str], train_args: list[str], *, what: str, output: str = "job-%j.out"
) -> Job:
    """Submit ``script`` (an sbatch example) with sbatch ``options`` over its own and ``train_args`` for train.py;
    ``what`` names the job in the tier's output. An array job (``output`` job-%A_%a.out): ``Job.array_task``."""
    output_path = folder / output
    command = ["sbatch", "--parsable", f"--chdir={REPO_ROOT}", f"--output={output_path}", "--nodes=1",
               "--cpus-per-task=1", *options, str(script), *train_args]  # fmt: skip
    env = child_env({"PATH": f"{REPO_ROOT / '.venv' / 'bin'}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"})
    submitted = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    job_id = submitted.stdout.strip().split(";")[0]
    return Job(job_id, Path(str(output_path).replace("%j", job_id).replace("%A", job_id)), what)


def train_args(data: SyntheticData, checkpoint_dir: Path, *extra: str) -> list[str]:
    return ["--imgs", str(data.imgs), "--masks", str(data.masks), "--checkpoint-dir", str(checkpoint_dir),
            "--base-channels", "8", "--scale", "1", "--batch-size", "2", "--deterministic", "--threads", "1",
            "--log-every", "1", *extra]  # fmt: skip
