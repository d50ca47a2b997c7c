"""Checkpoints under fire: killed mid-write, a full disk, a file size limit, a folder nobody may write, a truncated
file. Whatever happens, a file under a final name is complete and the previous checkpoint survives."""

from __future__ import annotations

import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO_ROOT, TrainRunner, assert_same_training_state, child_env, load_checkpoint
from tests.helpers import fill_disk, one_error_line, small_tmpfs, unwritable_folder
from utils.checkpoint.run_folder import PARTIAL_FILE_PATTERN

# Saves versions of a real training checkpoint, padded to a few MB so that every write takes a while, in a loop
# in a forked child (torch is imported once). Per line on stdin: fork a writer starting at that version, print its
# PID, and once the test has killed it print "reaped".
WRITER = """
import os, sys
import torch
from utils.checkpoint.files import save_checkpoint_atomic

run_dir = sys.argv[1]
base = torch.load(os.path.join(run_dir, "last.pth"), weights_only=True)
for line in sys.stdin:
    version = int(line)
    pid = os.fork()
    if pid == 0:
        while True:
            payload = {**base, "test_version": version, "test_padding": torch.full((1 << 20,), float(version))}
            save_checkpoint_atomic(payload, os.path.join(run_dir, "last.pth" if version % 2 else "best.pth"))
            version += 1
    print(pid, flush=True)
    os.waitpid(pid, 0)
    print("reaped", flush=True)
"""


@pytest.mark.slow
def test_killing_a_writer_at_random_moments_never_leaves_a_partial_checkpoint(runner: TrainRunner) -> None:
    assert runner.main("victim", "-e", "1", "--max-steps", "2") == 0
    run_dir = runner.run_dir("victim")
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(run_dir)],
        cwd=REPO_ROOT,
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    chance = random.Random(0)
    newest = {"last.pth": -1, "best.pth": -1}
    rounds_that_left_a_partial_file = 0
    try:
        for round_index in range(10):
            writer.stdin.write(f"{round_index * 1000}\n")
            writer.stdin.flush()
            child = int(writer.stdout.readline())
            # A save takes tens of milliseconds (fsync included): most kills land inside one.
            time.sleep(chance.uniform(0.05, 0.4))
            os.kill(child, signal.SIGKILL)
            assert writer.stdout.readline().strip() == "reaped"

            names = sorted(p.name for p in run_dir.iterdir())
            partial = [name for name in names if name.endswith(".tmp")]
            assert all(PARTIAL_FILE_PATTERN.match(name) for name in partial), names
            rounds_that_left_a_partial_file += bool(partial)
            for name in ("last.pth", "best.pth"):
                if not (run_dir / name).exists():
                    continue
                payload = load_checkpoint(run_dir / name)  # complete, or this raises
                version = payload.get("test_version", -1)
                if version >= 0:
                    assert torch.equal(payload["test_padding"], torch.full((1 << 20,), float(version))), name
                assert version >= newest[name], f"{name} went back from version {newest[name]} to {version}"
                newest[name] = version
    finally:
        writer.stdin.close()
        writer.kill()
        writer.wait()
    assert rounds_that_left_a_partial_file >= 1, "no kill landed inside a write"
    assert newest["last.pth"] >= 0 and newest["best.pth"] >= 0

    # The next start removes the leftovers and resumes from the newest complete state (last.pth or best.pth).
    assert runner.main("victim", "-e", "1", "--max-steps", "4", "--resume", "auto") == 0
    assert not [p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")]
    assert load_checkpoint(run_dir / "last.pth")["global_step"] == 4


def _start_and_save_once(runner: TrainRunner, exp_name: str) -> bytes:
    """A run stopped at step 1; returns the bytes of its last.pth."""
    assert runner.main(exp_name, "-e", "1", "--max-steps", "1") == 0
    return (runner.run_dir(exp_name) / "last.pth").read_bytes()


def _assert_error_kept_previous(run_dir: Path, previous: bytes, err: str, *needles: str) -> None:
    error = one_error_line(err)
    assert all(needle in error for needle in needles), error
    assert (run_dir / "last.pth").read_bytes() == previous
    assert not [p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")]


def test_a_full_disk_stops_with_a_clear_error_and_keeps_the_previous_checkpoint(
    runner: TrainRunner, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # A real filesystem with room for one checkpoint (about 6 MB) but not for its replacement next to it.
    with small_tmpfs(tmp_path / "small-disk", "9m") as mount_point:
        small = TrainRunner(runner.data, mount_point / "checkpoints")
        assert small.main("full", "-e", "1", "--save-every-steps", "1", "--max-steps", "3") == 2
        run_dir = small.run_dir("full")
        assert load_checkpoint(run_dir / "last.pth")["global_step"] == 1
        previous = (run_dir / "last.pth").read_bytes()
        _assert_error_kept_previous(
            run_dir, previous, capsys.readouterr().err, "No space left on device", "previous file", "--checkpoint-dir"
        )


def test_a_disk_already_full_at_start_is_the_same_one_line_error_as_during_a_save(
    runner: TrainRunner, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    with small_tmpfs(tmp_path / "full-disk", "3m") as disk:
        fill_disk(disk)
        full = TrainRunner(runner.data, disk / "checkpoints")
        assert full.main("full", "-e", "1") == 2
        error = one_error_line(capsys.readouterr().err)
    # The wording of a failed save (see the test above): the file, the reason, and the fixes.
    assert error.startswith(f"Error: could not write {disk / 'checkpoints' / 'full'}"), error
    assert "No space left on device" in error and "free disk space" in error and "--checkpoint-dir" in error


def test_a_file_size_limit_stops_with_a_clear_error_and_keeps_the_previous_checkpoint(
    runner: TrainRunner, capsys: pytest.CaptureFixture
) -> None:
    previous = _start_and_save_once(runner, "limited")
    capsys.readouterr()
    # Writes past 1 MB fail with EFBIG (Python ignores SIGXFSZ), as writes to a full disk fail with ENOSPC.
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        code = runner.main("limited", "-e", "1", "--max-steps", "3", "--resume", "auto")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert code == 2
    _assert_error_kept_previous(runner.run_dir("limited"), previous, capsys.readouterr().err, "File too large")


def test_a_folder_nobody_may_write_stops_with_a_clear_error(runner: TrainRunner, capsys: pytest.CaptureFixture) -> None:
    previous = _start_and_save_once(runner, "locked")
    capsys.readouterr()
    run_dir = runner.run_dir("locked")
    with unwritable_folder(run_dir) as refusal:
        code = runner.main("locked", "-e", "1", "--max-steps", "3", "--resume", "auto")
    assert code == 2
    _assert_error_kept_previous(
        run_dir, previous, capsys.readouterr().err, "could not write", refusal, "--checkpoint-dir"
    )


def test_a_checkpoint_dir_that_is_a_file_is_one_clear_error(
    runner: TrainRunner, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    in_the_way = tmp_path / "not-a-folder"
    in_the_way.write_text("x")
    argv = [*runner.args("blocked", "-e", "1"), "--checkpoint-dir", str(in_the_way / "sub")]
    import train

    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{in_the_way} is a file, not a folder" in err and "--checkpoint-dir" in err
    assert in_the_way.read_text() == "x"


def test_a_truncated_last_checkpoint_is_skipped_by_resume_auto_and_refused_by_resume_path(
    runner: TrainRunner, tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture
) -> None:
    # 15 training images, batch 2: 8 steps per epoch. Epoch 1 (checkpoint_epoch1.pth), then 4 steps of epoch 2.
    assert runner.main("cut", "-e", "2", "--max-steps", "12") == 0
    run_dir = runner.run_dir("cut")
    intact = tmp_path / "intact-last.pth"
    shutil.copy2(run_dir / "last.pth", intact)
    with open(run_dir / "last.pth", "r+b") as handle:  # cut in place, as a crashed copy or a bad disk would
        handle.truncate(intact.stat().st_size // 2)

    # --resume auto warns, takes the epoch 1 state, and redoes the 4 lost steps exactly.
    caplog.clear()
    assert runner.main("cut", "-e", "2", "--max-steps", "12", "--resume", "auto") == 0
    assert "skipping" in caplog.text and "last.pth" in caplog.text and "corrupt or truncated" in caplog.text
    assert "Resuming at epoch 2, step 8 (0 batches of the epoch done)" in caplog.text
    assert_same_training_state(intact, run_dir / "last.pth")

    # --resume PATH to a truncated file: one line, exit status 2, nothing written.
    truncated = tmp_path / "truncated.pth"
    truncated.write_bytes(intact.read_bytes()[:1000])
    capsys.readouterr()
    assert runner.main("other", "-e", "2", "--resume", str(truncated)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"Error: checkpoint {truncated} is corrupt or truncated")
    assert not (runner.run_dir("other") / "last.pth").exists()
