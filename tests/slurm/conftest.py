"""The real-SLURM tier: a single-node SLURM on this machine (``scripts/slurm_cluster.sh``), the project's sbatch
examples submitted to it, and the job states and exit codes SLURM itself records.

Runs only when asked (``UNET_DDP_SLURM_TESTS=1``, as ``.ci/run`` does as root): it installs packages and starts
daemons. Every test skips with one line otherwise.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, SyntheticData, child_env

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
def slurm() -> None:
    """Install (if needed) and start the single-node cluster; skip with one line where it cannot be."""
    if os.geteuid() != 0:
        pytest.skip("real-SLURM tier: needs root to install and start SLURM")
    started = subprocess.run(["bash", "scripts/slurm_cluster.sh", "start"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=600, check=False)  # fmt: skip
    if started.returncode != 0:
        pytest.skip(f"real-SLURM tier: scripts/slurm_cluster.sh start failed: {started.stderr.strip()[-300:]}")


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

    def fields(self) -> dict[str, str]:
        shown = subprocess.run(["scontrol", "show", "job", "-o", self.job_id], capture_output=True, text=True,
                               check=True).stdout  # fmt: skip
        return dict(re.findall(r"(\w+)=(\S*)", shown))

    def state(self) -> str:
        return self.fields()["JobState"]

    def wait(self, *, release_requeued: bool = True) -> dict[str, str]:
        """Poll until the job finished; a requeued job waits ~2 minutes (BeginTime) unless released at once."""
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while time.monotonic() < deadline:
            fields = self.fields()
            if fields["JobState"] in FINISHED_STATES:
                # One line per job in the tier's output (pytest -s or -rP): the states the docs and notes quote.
                print(f"SLURM job {self.job_id}: {fields['JobState']} {fields.get('ExitCode')} "
                      f"Restarts={fields.get('Restarts')} RunTime={fields.get('RunTime')}")  # fmt: skip
                return fields
            if release_requeued and fields["JobState"] == "PENDING" and fields.get("Reason") == "BeginTime":
                subprocess.run(["scontrol", "update", f"jobid={self.job_id}", "StartTime=now"], check=False)
            time.sleep(1)
        raise AssertionError(f"job {self.job_id} still {self.state()} after {JOB_TIMEOUT_S} s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return self.output.read_text() if self.output.exists() else ""


def adapted_example(name: str, folder: Path) -> Path:
    """``scripts/slurm/NAME`` for this machine: no GPUs requested, no --amp (CPUs); everything else as shipped."""
    lines = (REPO_ROOT / "scripts" / "slurm" / name).read_text().splitlines()
    kept = [line.replace(" --amp", "") for line in lines if "--gpus-per-node" not in line]
    script = folder / name
    script.write_text("\n".join(kept) + "\n")
    return script


def sbatch(script: Path, folder: Path, options: list[str], train_args: list[str]) -> Job:
    """Submit ``script`` (an sbatch example) with sbatch ``options`` over its own and ``train_args`` for train.py."""
    output = folder / "job-%j.out"
    command = ["sbatch", "--parsable", f"--chdir={REPO_ROOT}", f"--output={output}", "--nodes=1",
               "--cpus-per-task=1", *options, str(script), *train_args]  # fmt: skip
    env = child_env({"PATH": f"{REPO_ROOT / '.venv' / 'bin'}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"})
    submitted = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    job_id = submitted.stdout.strip().split(";")[0]
    return Job(job_id, Path(str(output).replace("%j", job_id)))


def train_args(data: SyntheticData, checkpoint_dir: Path, *extra: str) -> list[str]:
    return ["--imgs", str(data.imgs), "--masks", str(data.masks), "--checkpoint-dir", str(checkpoint_dir),
            "--base-channels", "8", "--scale", "1", "--batch-size", "2", "--deterministic", "--threads", "1",
            "--log-every", "1", *extra]  # fmt: skip
