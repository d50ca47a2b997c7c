"""No orphaned writers: when torchrun itself is killed, its workers stop within seconds, saving INTERRUPTED.pth.

The control runs the same check on workers without ``utils.launch.signals.stop_when_orphaned``: they outlive the killed
launcher, so the check can fail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from tests.conftest import (
    TrainRunner,
    child_env,
    finish,
    load_checkpoint,
    torchrun_prefix,
    wait_for_step,
    worker_pids,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find worker processes"),
]

ARGS = ["-v", "25", "-e", "30", "--classes", "1", "--log-every", "1", "--ddp_mode"]
# How long the workers of a killed launcher may take to stop (the hook's parent-PID check polls every second).
WINDOW_S = 10.0

# A torchrun worker without the hook: it records its PID and sleeps (bounded, should every clean-up fail).
_SLEEPER = """
import os, sys, time
from pathlib import Path
partial = Path(sys.argv[1], os.environ["RANK"] + ".partial")
partial.write_text(str(os.getpid()))
os.replace(partial, partial.with_suffix(".pid"))
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper has stopped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _survivors_of_killed_launcher(launcher: subprocess.Popen, workers: Iterable[int]) -> list[int]:
    """SIGKILL the launcher; the workers still running WINDOW_S later (it returns early once none runs)."""
    workers = list(workers)
    os.kill(launcher.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    while any(_alive(pid) for pid in workers) and time.monotonic() - killed_at < WINDOW_S:
        time.sleep(0.1)
    return [pid for pid in workers if _alive(pid)]


def _kill(pids: Iterable[int]) -> None:
    """Clean-up of workers a failed check left running (only the PIDs the test found under its own launcher)."""
    for pid in pids:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_workers_of_a_killed_torchrun_stop_save_and_the_run_continues(runner: TrainRunner) -> None:
    run_dir = runner.run_dir("orphaned")
    launcher = runner.popen(torchrun_prefix(2), "orphaned", *ARGS)
    wait_for_step(run_dir / "metrics.jsonl", 2, launcher)
    workers = worker_pids(launcher.pid)
    assert len(workers) == 2

    try:
        survivors = _survivors_of_killed_launcher(launcher, workers.values())
    finally:
        _kill(workers.values())
    assert not survivors, f"workers {survivors} outlived their launcher by {WINDOW_S:g} s"
    out, err = finish(launcher, timeout=30)  # the workers held its pipes: they are closed now
    assert "The launcher (PID" in out + err and "Stopped by SIGTERM" in out + err, out + err
    interrupted = load_checkpoint(run_dir / "INTERRUPTED.pth")
    assert interrupted["global_step"] >= 2 and interrupted["world_size"] == 2

    # --resume auto continues from it (here in one process).
    target = interrupted["global_step"] + 1
    assert runner.main("orphaned", *ARGS[:-1], "--max-steps", str(target), "--resume", "auto") == 0
    assert load_checkpoint(run_dir / "last.pth")["global_step"] == target


def test_control_workers_without_the_hook_outlive_a_killed_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(_SLEEPER)
    launcher = subprocess.Popen(
        [*torchrun_prefix(2), str(script), str(tmp_path)],
        cwd=tmp_path,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    recorded: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while len(recorded) < 2 and time.monotonic() < deadline and launcher.poll() is None:
            recorded = {int(path.read_text()) for path in tmp_path.glob("*.pid")}
            time.sleep(0.05)
        workers = worker_pids(launcher.pid)
        assert set(workers.values()) == recorded and len(recorded) == 2, f"workers {workers}, PID files {recorded}"
        assert sorted(_survivors_of_killed_launcher(launcher, workers.values())) == sorted(recorded)
    finally:
        _kill(recorded | set(worker_pids(launcher.pid).values()))  # also those that failed before their PID file
        launcher.kill()
        finish(launcher, timeout=30)
