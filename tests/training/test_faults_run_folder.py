"""One owner of the run folder: its lock, reruns into numbered folders, and clean-up only under the lock.

Real processes: a live run holds the lock while others start against its folder.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TrainRunner, finish, load_checkpoint, wait_for_step
from tests.helpers import one_error_line
from utils.training.run_folder import RunFolder, RunSeries

LONG = ["-e", "30", "--log-every", "1"]


def _first_to_exit(processes: list, timeout_s: float = 120) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for index, process in enumerate(processes):
            if process.poll() is not None:
                return index
        time.sleep(0.05)
    for process in processes:
        process.kill()
    raise AssertionError("neither run exited")


def test_two_runs_on_one_folder_one_runs_the_other_stops_and_nothing_live_is_touched(runner: TrainRunner) -> None:
    run_dir = runner.run_dir("same")
    python = [sys.executable]
    both = [runner.popen(python, "same", *LONG, "--resume", "auto") for _ in range(2)]
    loser = both[_first_to_exit(both)]
    winner = both[1 - both.index(loser)]
    out, err = finish(loser)
    assert loser.returncode == 2, out + err
    error = one_error_line(err)
    assert f"run folder {run_dir} is in use by another training process (PID {winner.pid})" in error
    assert "--exp_name" in error
    wait_for_step(run_dir / "metrics.jsonl", 2, winner)

    # A write in progress of the live run looks like a leftover: nobody but the lock holder may remove it.
    in_progress = run_dir / ".last.pth.inprogress.tmp"
    in_progress.write_bytes(b"being written")
    again = runner.popen(python, "same", *LONG, "--resume", "auto")
    _, err = finish(again)
    assert again.returncode == 2 and "is in use" in one_error_line(err)
    # Without --resume a start never touches the live folder: it begins the next one.
    rerun = runner.popen(python, "same", "-e", "1", "--max-steps", "1")
    out, err = finish(rerun)
    assert rerun.returncode == 0, out + err
    assert f"this run writes to {runner.run_dir('same-2')}" in out + err
    assert (runner.run_dir("same-2") / "last.pth").is_file()
    assert in_progress.read_bytes() == b"being written"
    assert winner.poll() is None

    # kill -9 leaves no stale lock: the kernel releases it, and --resume auto continues the newest folder of the
    # series (same-2) - or, asked for this one by path, this one, removing what the killed write left.
    winner.send_signal(signal.SIGKILL)
    finish(winner)
    target = load_checkpoint(run_dir / "last.pth")["global_step"] + 2  # epoch 1 ended long ago
    resumed = runner.popen(python, "same", *LONG, "--max-steps", str(target), "--resume", str(run_dir / "last.pth"))
    out, err = finish(resumed)
    assert resumed.returncode == 0, out + err
    assert not in_progress.exists()
    assert load_checkpoint(run_dir / "last.pth")["global_step"] == target


def test_the_lock_names_its_holder_and_is_released_with_the_process(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    assert folder.try_lock() is None
    other = RunFolder(tmp_path / "run")
    assert other.try_lock() == os.getpid() and other.is_locked_by_another()
    with pytest.raises(Exception, match=rf"run folder {folder.path} is in use by another training process \(PID "):
        other.lock()
    folder.unlock()
    assert other.try_lock() is None
    other.unlock()


def test_series_numbers_folders_and_skips_live_and_used_ones(tmp_path: Path) -> None:
    series = RunSeries(tmp_path, "unet")
    first = series.start_new()
    assert first.path == tmp_path / "unet"
    # Held by a live run (this process, through another open file): the next start takes unet-2.
    second = series.start_new()
    assert second.path == tmp_path / "unet-2"
    first.unlock()
    second.unlock()
    # unet-2 holds nothing: a new start reuses it; once it holds metrics, the next is unet-3.
    assert series.start_new().path == tmp_path / "unet-2"
    (tmp_path / "unet-2" / "metrics.jsonl").write_text("{}\n")
    assert series.newest().path == tmp_path / "unet-2"
    third = series.start_new()
    assert third.path == tmp_path / "unet-3"
    assert RunSeries(tmp_path, "unet-3").newest().path == tmp_path / "unet-3"  # its own series: unet-3, unet-3-2


def test_a_torchrun_restart_continues_its_own_folder_without_resume(tmp_path: Path) -> None:
    from utils.training.setup import _choose_run

    (tmp_path / "unet").mkdir()
    (tmp_path / "unet" / "metrics.jsonl").write_text("{}\n")  # a finished run
    series = RunSeries(tmp_path, "unet")
    chosen: list[RunFolder] = []
    assert _choose_run(None, series, 0, {}, chosen) == (str(tmp_path / "unet-2"), None)  # the first attempt
    (tmp_path / "unet-2" / "metrics.jsonl").write_text("{}\n")
    chosen.pop().unlock()  # the attempt's workers died
    # The restarted attempt (TORCHELASTIC_RESTART_COUNT=1) continues unet-2 instead of beginning unet-3.
    assert _choose_run(None, series, 1, {}, chosen) == (str(tmp_path / "unet-2"), None)
    chosen.pop().unlock()
    assert not (tmp_path / "unet-3").exists()
