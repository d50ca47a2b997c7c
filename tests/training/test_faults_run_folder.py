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
from utils.checkpoint.files import load_resume_checkpoint
from utils.checkpoint.run_folder import RunFolder, RunSeries, choose_run
from utils.errors import ConfigError

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


@pytest.mark.slow
def test_two_runs_on_one_folder_one_runs_the_other_stops_and_nothing_live_is_touched(
    runner: TrainRunner, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    # The two competing starts are processes; the later starts run in this process (no interpreter start-up), which
    # is another process than the live run's, as a second job's would be. train.py's exit path as a process is
    # tested by the loser here and in test_train_single.py.
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
    capsys.readouterr()
    assert runner.main("same", *LONG, "--resume", "auto") == 2
    assert f"is in use by another training process (PID {winner.pid})" in one_error_line(capsys.readouterr().err)
    # Without --resume a start never touches the live folder: it begins the next one.
    with caplog.at_level("INFO"):
        assert runner.main("same", "-e", "1", "--max-steps", "1") == 0
    assert f"this run writes to {runner.run_dir('same-2')}" in caplog.text
    assert (runner.run_dir("same-2") / "last.pth").is_file()
    assert in_progress.read_bytes() == b"being written"
    assert winner.poll() is None

    # kill -9 leaves no stale lock: the kernel releases it, and --resume auto continues the newest folder of the
    # series (same-2) - or, asked for this one by path, this one, removing what the killed write left.
    deadline = time.monotonic() + 120  # the starts above can take less than the live run's first epoch
    while not (run_dir / "last.pth").is_file() and winner.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    winner.send_signal(signal.SIGKILL)
    finish(winner)
    target = load_checkpoint(run_dir / "last.pth")["global_step"] + 2
    assert runner.main("same", *LONG, "--max-steps", str(target), "--resume", str(run_dir / "last.pth")) == 0
    assert not in_progress.exists()
    assert load_checkpoint(run_dir / "last.pth")["global_step"] == target


def test_the_lock_names_its_holder_and_is_released_with_the_process(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "run")
    assert folder.lock()
    other = RunFolder(tmp_path / "run")
    assert not other.lock(in_use_is_an_error=False)
    in_use = rf"run folder {folder.path} is in use by another training process \(PID {os.getpid()}\); wait"
    with pytest.raises(ConfigError, match=in_use):
        other.lock()
    folder.unlock()
    assert other.lock(in_use_is_an_error=False)
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


def chosen_run(resume: str | Path | None, series: RunSeries, restart_count: int) -> tuple[str, str | None]:
    """Rank 0's choice of folder and resume file (as paths), with the folder's lock released again."""
    choice = choose_run(None if resume is None else str(resume), series, restart_count)
    choice.folder.unlock()  # as when the attempt's workers die
    return str(choice.folder.path), choice.resume_path


def test_a_torchrun_restart_continues_its_own_folder_without_resume(tmp_path: Path) -> None:
    (tmp_path / "unet").mkdir()
    (tmp_path / "unet" / "metrics.jsonl").write_text("{}\n")  # a finished run
    series = RunSeries(tmp_path, "unet")
    assert chosen_run(None, series, 0) == (str(tmp_path / "unet-2"), None)  # the first attempt
    (tmp_path / "unet-2" / "metrics.jsonl").write_text("{}\n")
    # The restarted attempt (TORCHELASTIC_RESTART_COUNT=1) continues unet-2 instead of beginning unet-3.
    assert chosen_run(None, series, 1) == (str(tmp_path / "unet-2"), None)
    assert not (tmp_path / "unet-3").exists()


# 12 training images, batches of 2: 6 steps per epoch.
SHORT = ["-v", "25", "-e", "3"]


def _files(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file of ``folder`` (the lock file too) with its bytes and modification time: touched or not."""
    return {path.name: (path.read_bytes(), path.stat().st_mtime_ns) for path in folder.iterdir() if path.is_file()}


def test_resume_from_an_older_state_begins_the_next_folder_and_leaves_the_old_one_untouched(
    runner: TrainRunner, capsys: pytest.CaptureFixture
) -> None:
    run_dir = runner.run_dir("unet")
    assert runner.main("unet", *SHORT, "--max-steps", "8") == 0  # epoch 1's files, then last.pth at step 8
    older = run_dir / "checkpoint_epoch1.pth"

    # While a live run holds the folder, its newest state is not ours to continue; an older one still branches off.
    live, series = RunFolder(run_dir), RunSeries(runner.checkpoint_dir, "unet")
    assert live.lock()
    try:
        with pytest.raises(ConfigError, match=rf"run folder {run_dir} is in use by another training process"):
            chosen_run(run_dir / "last.pth", series, 0)
        assert chosen_run(older, series, 0) == (str(runner.run_dir("unet-2")), str(older))
    finally:
        live.unlock()

    before = _files(run_dir)
    capsys.readouterr()
    assert runner.main("unet", *SHORT, "--max-steps", "10", "--resume", str(older)) == 0
    out = capsys.readouterr().out
    # Continuing in unet/ would have replaced its last.pth (step 8) with the rewound run's.
    assert _files(run_dir) == before
    rerun = runner.run_dir("unet-2")
    assert f"--resume {older} is not the newest state of {run_dir} (continuing there would overwrite" in out
    assert f"this run writes to {rerun}" in out
    assert load_checkpoint(rerun / "last.pth")["global_step"] == 10

    # From the folder's newest state the run continues there, although unet-2 is newer.
    assert runner.main("unet", *SHORT, "--max-steps", "9", "--resume", str(run_dir / "last.pth")) == 0
    assert "this run writes to" not in capsys.readouterr().out
    assert load_checkpoint(run_dir / "last.pth")["global_step"] == 9
    assert not runner.run_dir("unet-3").exists()


def test_resume_from_a_copy_of_the_newest_state_continues_its_folder(
    runner: TrainRunner, capsys: pytest.CaptureFixture
) -> None:
    run_dir = runner.run_dir("unet")
    assert runner.main("unet", *SHORT, "-e", "1") == 0
    folder = RunFolder(run_dir)
    # The epoch end wrote last.pth first, then copied it to checkpoint_epoch1.pth: the copy is the newest full-state
    # file, by a clear margin here (a coarse file clock can give both one time). best.pth is weights-only.
    written = folder.last.stat().st_mtime_ns
    copy = folder.epoch_checkpoint(1)
    assert copy.stat().st_mtime_ns >= written
    os.utime(copy, ns=(written + 10**9, written + 10**9))
    assert folder.find_resume_checkpoint()[0] == copy
    assert folder.can_continue_from(load_resume_checkpoint(folder.last))
    capsys.readouterr()
    assert runner.main("unet", *SHORT, "-e", "1", "--resume", str(folder.last)) == 0
    out = capsys.readouterr().out
    assert f"Resuming from {folder.last}" in out and "this run writes to" not in out
    assert not runner.run_dir("unet-2").exists()


def test_resume_from_outside_the_series_takes_the_newest_folder_only_when_it_is_empty(
    runner: TrainRunner, capsys: pytest.CaptureFixture
) -> None:
    assert runner.main("donor", *SHORT, "--max-steps", "3") == 0
    donor = runner.run_dir("donor") / "last.pth"
    assert runner.main("unet", *SHORT, "--max-steps", "2") == 0
    donor_before, unet_before = _files(donor.parent), _files(runner.run_dir("unet"))
    capsys.readouterr()
    # Was refused ("choose another --exp_name"); now it begins unet-2 as a rerun does.
    assert runner.main("unet", *SHORT, "--max-steps", "4", "--resume", str(donor)) == 0
    assert f"this run writes to {runner.run_dir('unet-2')}" in capsys.readouterr().out
    assert load_checkpoint(runner.run_dir("unet-2") / "last.pth")["global_step"] == 4
    assert _files(runner.run_dir("unet")) == unet_before and _files(donor.parent) == donor_before
    # A series with no run yet: its first folder.
    assert runner.main("fresh", *SHORT, "--max-steps", "4", "--resume", str(donor)) == 0
    assert "this run writes to" not in capsys.readouterr().out
    assert load_checkpoint(runner.run_dir("fresh") / "last.pth")["global_step"] == 4
    assert not runner.run_dir("fresh-2").exists()


def test_a_torchrun_restart_of_resume_path_continues_the_folder_its_first_attempt_took(runner: TrainRunner) -> None:
    run_dir = runner.run_dir("unet")
    series = RunSeries(runner.checkpoint_dir, "unet")
    assert runner.main("unet", *SHORT, "--max-steps", "7") == 0
    older = run_dir / "checkpoint_epoch1.pth"

    def restart(resume: Path) -> tuple[str, str | None]:
        """The decision of the restarted attempt (TORCHELASTIC_RESTART_COUNT=1) with the same command line."""
        return chosen_run(resume, series, 1)

    # The first attempt resumed the older state into unet-2 and saved at step 8: the restart continues that, where
    # resuming checkpoint_epoch1.pth again would throw the attempt's progress away.
    assert runner.main("unet", *SHORT, "--max-steps", "8", "--resume", str(older)) == 0
    rerun = runner.run_dir("unet-2")
    assert restart(older) == (str(rerun), str(rerun / "last.pth"))
    # The first attempt continued unet/ (an older folder than unet-2) from its newest state: the restart goes there.
    assert runner.main("unet", *SHORT, "--max-steps", "9", "--resume", str(run_dir / "last.pth")) == 0
    assert restart(run_dir / "last.pth") == (str(run_dir), str(run_dir / "last.pth"))
    assert load_checkpoint(run_dir / "last.pth")["global_step"] == 9

    # A first attempt that died before its first save: its folder (unet-3) holds no checkpoint, so PATH it is.
    assert chosen_run(older, series, 0) == (str(runner.run_dir("unet-3")), str(older))
    assert restart(older) == (str(runner.run_dir("unet-3")), str(older))
    assert not runner.run_dir("unet-4").exists()


def test_a_linked_metrics_jsonl_is_refused_and_its_target_kept(runner: TrainRunner, tmp_path: Path, capsys) -> None:
    # As a linked tensorboard/: the run's records would be appended to whatever the link names (an input, say).
    kept = tmp_path / "notes.txt"
    kept.write_text("mine\n")
    run_dir = runner.run_dir("linked")
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").symlink_to(kept)
    assert runner.main("linked", "-e", "1", "--resume", "auto") == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"{run_dir / 'metrics.jsonl'} is a link to {kept}" in line and "remove the link" in line, line
    assert kept.read_text() == "mine\n"
