"""Ctrl-C under torchrun for real: SIGINT to the launcher's whole process group, as a terminal sends it."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from tests.conftest import TrainRunner, finish, load_checkpoint, torchrun_prefix, wait_for_step

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and signals as on Linux"),
]


def test_ctrl_c_under_torchrun_saves_then_torchrun_exits_1_with_its_signal_exception(runner: TrainRunner) -> None:
    run_dir = runner.run_dir("ctrl-c")
    # A session of its own: the launcher leads a process group holding it and its workers, like a terminal's job.
    launcher = runner.popen(torchrun_prefix(2), "ctrl-c", "-e", "30", "--log-every", "1", "--ddp_mode",
                            start_new_session=True)  # fmt: skip
    wait_for_step(run_dir / "metrics.jsonl", 1, launcher)
    os.killpg(launcher.pid, signal.SIGINT)
    out, err = finish(launcher)
    # The workers stop as train.py does alone (rank 0 saves and says how to resume)...
    assert "[rank 0] WARNING Stopped by SIGINT" in out and "--resume auto" in out
    assert load_checkpoint(run_dir / "INTERRUPTED.pth")["global_step"] >= 1
    # ...and torchrun, whose own handler turns SIGINT into a SignalException, forwards SIGINT to the workers, waits
    # for them, then lets the exception end it: a traceback and status 1, whatever the workers' statuses were.
    assert "closing signal SIGINT" in err
    assert "SignalException" in err
    assert launcher.returncode == 1
