"""Running a measurement in a process of its own: thread count set before torch starts, a time limit, peak RSS.

A worker is a function from a JSON-able spec to a JSON-able dict. The orchestrator runs it as
``scripts/benchmark.py --worker NAME --spec JSON`` (the child prints its result on one ``BENCHMARK_RESULT`` line), or
in its own process when ``--no-isolate`` (``--quick``) saves the interpreter start-ups. Heavy imports stay inside the
workers, so that the orchestrator starts quickly and a worker's thread count is set before its first parallel region.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scripts.bench.context import BenchConfig
from utils.launch.environments import is_launcher_variable

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCHMARK_SCRIPT = REPO_ROOT / "scripts" / "benchmark.py"
RESULT_PREFIX = "BENCHMARK_RESULT "
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# Worker name -> "module:function", imported only in the process that runs it.
WORKERS = {
    "compute": "scripts.bench.training:compute_worker",
    "epoch-bound": "scripts.bench.epoch:bound_worker",
    "data-build": "scripts.bench.data:build_worker",
    "data-load": "scripts.bench.data:load_worker",
    "predict": "scripts.bench.prediction:predict_worker",
}


class MeasurementError(RuntimeError):
    """A measured process failed; the message carries the end of its output."""


@dataclass
class ChildRun:
    returncode: int
    wall_s: float
    max_rss_mib: float
    """Peak RSS of the largest process of the tree (the child or any of its descendants it waited for)."""
    output: str


def child_env(threads: int) -> dict[str, str]:
    """This environment without a launcher's variables, with ``threads`` CPU threads and the repository importable."""
    env = {k: v for k, v in os.environ.items() if not is_launcher_variable(k)}
    for name in THREAD_VARIABLES:
        env[name] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_child(command: Sequence[str], *, threads: int, timeout: float, log_path: Path) -> ChildRun:
    """Run ``command`` in its own process group; its output goes to ``log_path``; peak RSS comes from ``wait4``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            list(command),
            cwd=REPO_ROOT,
            env=child_env(threads),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        timed_out = threading.Event()

        def kill_group() -> None:
            timed_out.set()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)

        timer = threading.Timer(timeout, kill_group)
        timer.start()
        try:
            _, status, usage = os.wait4(process.pid, 0)
        except BaseException:
            # Interrupted (Ctrl-C, SIGTERM): the child runs in a session of its own, so take it down explicitly.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(process.pid, 0)
            raise
        finally:
            timer.cancel()
        process.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    output = log_path.read_text(errors="replace")
    if timed_out.is_set():
        raise MeasurementError(f"{_shown(command)} ran past --timeout {timeout:g} s; see {log_path}")
    return ChildRun(process.returncode, wall, usage.ru_maxrss / 1024, output)


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def call_worker(name: str, spec: dict[str, Any], *, threads: int, config: BenchConfig, log_dir: Path) -> dict[str, Any]:
    """Run worker ``name`` in a fresh process (``config.isolate``) or in this one; its result dict plus memory."""
    spec = {**spec, "threads": threads}
    if not config.isolate:
        torch.set_num_threads(threads)
        with contextlib.redirect_stdout(io.StringIO()):
            result = resolve_worker(name)(spec)
        result["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        result["isolated"] = False
        return result
    command = [sys.executable, str(BENCHMARK_SCRIPT), "--worker", name, "--spec", json.dumps(spec)]
    log_path = log_dir / f"{name}-{int(time.time() * 1000)}.log"
    run = run_child(command, threads=threads, timeout=config.timeout, log_path=log_path)
    lines = [line for line in run.output.splitlines() if line.startswith(RESULT_PREFIX)]
    if run.returncode != 0 or not lines:
        raise MeasurementError(f"worker {name} failed (exit {run.returncode}):\n{tail(run.output)}")
    result = json.loads(lines[-1][len(RESULT_PREFIX) :])
    result["max_rss_mib"] = run.max_rss_mib
    result["isolated"] = True
    return result


def worker_main(name: str, spec_json: str) -> int:
    """The child's side of ``call_worker``: run the worker, print its result on the line the parent looks for."""
    spec = json.loads(spec_json)
    if "threads" in spec:
        torch.set_num_threads(spec["threads"])
    result = resolve_worker(name)(spec)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


def resolve_worker(name: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    module_name, function = WORKERS[name].split(":")
    return getattr(importlib.import_module(module_name), function)


def _shown(command: Sequence[str]) -> str:
    return " ".join(str(part) for part in command[:6]) + (" ..." if len(command) > 6 else "")
