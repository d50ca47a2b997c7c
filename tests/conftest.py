"""Shared fixtures: tiny synthetic datasets and helpers to run ``train.py`` in-process or as real processes."""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import read_metrics
from utils.launch.environments import is_launcher_variable

REPO_ROOT = Path(__file__).resolve().parent.parent

# Inductor compiles in a pool of one worker process per core by default: on the 2 cores the suite runs on, the pool's
# start-up and its workers beside the tests' own processes cost more than they save (the compile tests measured 17 %
# less CPU with one thread). Set before anything imports torch._inductor.config; train.py's children inherit it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# The tests prove what --compile does (what compiles when, the cache a resume finds, the weights it trains), not how
# fast inductor's kernels run: its scalar C++ kernels compile in about half the time of its vectorised ones (a cold
# compile of the tiny model's blocks, one process: 47 s against 84 s here). The benchmark, run on its own, keeps them.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist every worker computes with one thread: the workers already share the cores, and two threads
    per worker on as many cores as workers wait for each other at OpenMP's barriers."""
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each pytest-xdist worker starts with its share of the slow tests and ends with short ones.

    ``scripts/test.sh`` runs ``--dist worksteal``, which hands the workers consecutive chunks of this order, sized as
    below, and lets an idle worker take the end of a busy one's queue (but never its last two tests). So each chunk
    opens with every N-th slow test (the compile tests, a minute each on a CPU, first) and is filled up with short
    tests: the long ones start early, the short ones are what moves between workers, and no worker is left running
    slow tests alone at the end. Without xdist the slow tests simply run first.
    """
    slow = sorted(
        (item for item in items if item.get_closest_marker("slow")), key=lambda i: "compile" not in i.path.name
    )
    short = iter([item for item in items if not item.get_closest_marker("slow")])
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    ordered, remaining = [], len(items)
    for worker in range(workers):
        size = remaining // (workers - worker)  # worksteal's first split of the queue
        remaining -= size
        share = slow[worker::workers]
        ordered += [*share, *itertools.islice(short, max(0, size - len(share)))]
    items[:] = [*ordered, *short]


@dataclass(frozen=True)
class SyntheticData:
    imgs: Path
    masks: Path
    n_images: int


@pytest.fixture(scope="session")
def carvana_data(tmp_path_factory: pytest.TempPathFactory) -> SyntheticData:
    """16 Carvana-style 48x32 images (binary masks, '<id>_mask.gif' names), shared by the whole session."""
    from utils.datasets.synthetic import generate_carvana_like

    root = tmp_path_factory.mktemp("carvana")
    generate_carvana_like(root, 16, size=(48, 32), seed=0)
    return SyntheticData(root / "imgs", root / "masks", 16)


@dataclass
class TrainRunner:
    """Builds train.py command lines for a tiny model on ``data`` with run folders under ``checkpoint_dir``."""

    data: SyntheticData
    checkpoint_dir: Path

    def args(self, exp_name: str, *extra: str) -> list[str]:
        return [
            "--imgs", str(self.data.imgs),
            "--masks", str(self.data.masks),
            "--checkpoint-dir", str(self.checkpoint_dir),
            "--exp_name", exp_name,
            "--base-channels", "8",
            "--scale", "1",
            "--batch-size", "2",
            "--learning-rate", "1e-3",
            "--deterministic",
            # One thread: on a busy machine (tests run in parallel) two threads per process wait for each other.
            "--threads", "1",
            *extra,
        ]  # fmt: skip

    def run_dir(self, exp_name: str) -> Path:
        return self.checkpoint_dir / exp_name

    def main(self, exp_name: str, *extra: str) -> int:
        """``train.main`` in this process (fast: no interpreter start-up)."""
        import train

        try:
            return train.main(self.args(exp_name, *extra))
        finally:
            # Global switches a run sets for itself must not leak into the other tests of the session.
            torch.use_deterministic_algorithms(False)

    def popen(self, prefix: Sequence[str], exp_name: str, *extra: str, env: dict[str, str] | None = None, **kw: Any):
        """Start ``prefix + [train.py] + args`` as a real process (prefix: a python or launcher command)."""
        return subprocess.Popen(
            [*prefix, "train.py", *self.args(exp_name, *extra)],
            cwd=REPO_ROOT,
            env=child_env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **kw,
        )


@pytest.fixture
def runner(carvana_data: SyntheticData, tmp_path: Path) -> TrainRunner:
    return TrainRunner(carvana_data, tmp_path / "checkpoints")


@pytest.fixture
def self_labelled_masks(carvana_data: SyntheticData, tmp_path: Path) -> Callable[[Path], Path]:
    """Labels ``carvana_data``'s images with a checkpoint's own predictions: call it with the checkpoint.

    Returns the masks folder ('<id>.png' names, the checkpoint's mask values), on which evaluate.py must score that
    model perfectly.
    """
    import predict

    def label(checkpoint: Path) -> Path:
        predicted, masks = tmp_path / "predicted", tmp_path / "self-labelled"
        code = predict.main(["-m", str(checkpoint), "-i", str(carvana_data.imgs), "--output-dir", str(predicted),
                             "-s", "1", "-b", "4", "--no-progress", "-j", "0"])  # fmt: skip
        assert code == 0
        masks.mkdir()
        for output in sorted(predicted.glob("*_OUT.png")):
            shutil.move(output, masks / f"{output.stem.removesuffix('_OUT')}.png")
        return masks

    return label


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not is_launcher_variable(key)}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run_ranks(rank_main: Callable[..., None], args: tuple, nprocs: int, *, backward: bool = False) -> None:
    """``rank_main(rank, *args)`` in ``nprocs`` processes started from this one, joined; a rank's error fails the test.

    Forked where they can be: a spawned rank imports torch and the test module again (seconds of CPU each). Each rank
    sets one thread before computing (a forked child must not enter the OpenMP pool its parent may have started).
    Ranks that run a ``backward`` are spawned: torch refuses a backward in a child forked after the parent ran one,
    which an earlier test in this pytest worker may have done.
    """
    method = "spawn" if backward else "fork"
    torch.multiprocessing.start_processes(rank_main, args=args, nprocs=nprocs, join=True, start_method=method)


def free_port() -> int:
    """A port free now (for addresses another process must know in advance; it may be taken before it is bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_prefix(nproc: int = 2) -> list[str]:
    """``torchrun`` with a c10d rendezvous on 127.0.0.1 as the current interpreter's module.

    Port 0: the launcher binds a port the system picks, so no other process can take it between choosing and binding.
    """
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0",
    ]  # fmt: skip


def wait_for_step(metrics_path: Path, step: int, process: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Block until ``metrics.jsonl`` records a train event at ``step`` or later (the run is really training)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            out, err = process.communicate()
            raise AssertionError(f"training exited early with {process.returncode}:\n{out}\n{err}")
        if metrics_path.exists():
            trained = read_metrics(metrics_path, event="train", partial_ok=True)
            if any(event["global_step"] >= step for event in trained):
                return
        time.sleep(0.05)
    process.kill()
    raise AssertionError(f"no training step {step} within {timeout_s} s")


def finish(process: subprocess.Popen, timeout: float = 240) -> tuple[str, str]:
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"process did not finish within {timeout} s:\n{out}\n{err}") from None


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """Rank -> PID of the launcher's child processes (children from /proc, ranks from their environment)."""
    pids = {}
    for children in Path(f"/proc/{launcher_pid}/task").glob("*/children"):
        for pid in children.read_text().split():
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for entry in environ:
                if entry.startswith(b"RANK="):
                    pids[int(entry[len("RANK=") :])] = int(pid)
    return pids


def load_checkpoint(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_training_state(first: Path, second: Path) -> None:
    """Bit-identical model weights (every tensor; with --ema the average and the trained weights), optimizer state and
    position of two checkpoints."""
    a, b = load_checkpoint(first), load_checkpoint(second)
    assert a["global_step"] == b["global_step"]
    assert (a["epoch"], a["step_in_epoch"]) == (b["epoch"], b["step_in_epoch"])
    assert ("live_model_state" in a) == ("live_model_state" in b)
    for weights in ["model_state", *(["live_model_state"] if "live_model_state" in a else [])]:
        assert a[weights].keys() == b[weights].keys()
        for key, tensor in a[weights].items():
            assert torch.equal(tensor, b[weights][key]), f"{weights} tensor {key} differs"
    state_a, state_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert state_a.keys() == state_b.keys()
    for index in state_a:
        for name, value in state_a[index].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(state_b[index][name])), (
                f"optimizer {index}.{name}"
            )
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"]
