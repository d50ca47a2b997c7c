"""No orphaned writers: when torchrun itself is killed, its workers stop within seconds, saving INTERRUPTED.pth."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TrainRunner, finish, load_checkpoint, torchrun_prefix, wait_for_step, worker_pids

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find worker processes")

ARGS = ["-v", "25", "-e", "30", "--classes", "1", "--log-every", "1", "--ddp_mode"]


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper has stopped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_workers_of_a_killed_torchrun_stop_save_and_the_run_continues(runner: TrainRunner) -> None:
    run_dir = runner.run_dir("orphaned")
    launcher = runner.popen(torchrun_prefix(2), "orphaned", *ARGS)
    wait_for_step(run_dir / "metrics.jsonl", 2, launcher)
    workers = worker_pids(launcher.pid)
    assert len(workers) == 2

    os.kill(launcher.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    while any(_alive(pid) for pid in workers.values()) and time.monotonic() - killed_at < 10:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers.values()), "workers outlived their launcher by 10 s"
    out, err = finish(launcher, timeout=30)  # the workers held its pipes: they are closed now
    assert "The launcher (PID" in out + err and "Stopped by SIGTERM" in out + err, out + err
    interrupted = load_checkpoint(run_dir / "INTERRUPTED.pth")
    assert interrupted["global_step"] >= 2 and interrupted["world_size"] == 2

    # --resume auto continues from it (here in one process).
    target = interrupted["global_step"] + 1
    assert runner.main("orphaned", *ARGS[:-1], "--max-steps", str(target), "--resume", "auto") == 0
    assert load_checkpoint(run_dir / "last.pth")["global_step"] == target
