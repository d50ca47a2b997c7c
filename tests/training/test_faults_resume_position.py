"""``--resume auto`` ranks a run folder's checkpoints by the position recorded inside them, never by mtime.

A copy or a sync (rsync without -t, cp without -p, a restore from backup) gives files new modification times: an
older state must still never be resumed over a newer one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import TrainRunner, load_checkpoint
from tests.helpers import read_metrics
from utils.checkpoint.run_folder import RunFolder

SHORT = ["-v", "25", "-e", "3", "--log-every", "1"]  # 12 training images, batch 2: 6 steps per epoch


def _touch(path: Path, seconds_from_now: int) -> None:
    when = int((os.stat(path).st_mtime + seconds_from_now) * 1e9)
    os.utime(path, ns=(when, when))


@pytest.fixture
def folder_of_three_steps(runner: TrainRunner) -> RunFolder:
    """A run folder holding states at steps 3 (INTERRUPTED.pth, a stale stop), 6 (epoch 1's files) and 8 (last.pth)."""
    assert runner.main("unet", *SHORT, "--max-steps", "3") == 0
    folder = RunFolder(runner.run_dir("unet"))
    stale = folder.path / "stale.bin"
    shutil.copyfile(folder.last, stale)
    assert runner.main("unet", *SHORT, "--max-steps", "8", "--resume", "auto") == 0
    os.replace(stale, folder.interrupted)
    steps = {path.name: load_checkpoint(path)["global_step"] for path in folder.checkpoint_files()}
    assert steps == {"last.pth": 8, "checkpoint_epoch1.pth": 6, "INTERRUPTED.pth": 3}, steps  # best.pth: weights only
    return folder


def test_auto_takes_the_furthest_step_whatever_the_mtimes_say(
    runner: TrainRunner, folder_of_three_steps: RunFolder, capsys: pytest.CaptureFixture
) -> None:
    folder = folder_of_three_steps
    # A sync that wrote the files in the "wrong" order: the oldest state now looks the newest, the newest the oldest.
    _touch(folder.interrupted, 300)
    _touch(folder.epoch_checkpoint(1), 200)
    _touch(folder.best, 100)
    _touch(folder.last, -300)
    found = folder.find_resume_checkpoint()
    assert found is not None and found[0] == folder.last and found[1]["global_step"] == 8
    before = folder.last.read_bytes()
    capsys.readouterr()
    assert runner.main("unet", *SHORT, "--max-steps", "9", "--resume", "auto") == 0
    out = capsys.readouterr().out
    assert f"Resuming from {folder.last}" in out and "step 8" in out, out
    assert load_checkpoint(folder.last)["global_step"] == 9
    assert folder.last.read_bytes() != before


def test_a_corrupt_furthest_file_falls_back_to_the_next_step_not_to_the_newest_mtime(
    folder_of_three_steps: RunFolder,
) -> None:
    folder = folder_of_three_steps
    data = bytearray(folder.last.read_bytes())
    folder.last.write_bytes(bytes(data[: len(data) // 2]))  # truncated: unreadable, ranked last
    _touch(folder.interrupted, 300)
    found = folder.find_resume_checkpoint()
    assert found is not None and found[1]["global_step"] == 6 and found[0] != folder.interrupted


def test_a_torn_last_metrics_line_is_cut_off_by_the_resume(runner: TrainRunner, caplog) -> None:
    """A crash while a record was written leaves half a line: the resume drops it (one warning) before appending, so
    the file stays one whole JSON record per line instead of gluing its next record onto the fragment."""
    assert runner.main("torn", *SHORT, "--max-steps", "3") == 0
    metrics = runner.run_dir("torn") / "metrics.jsonl"
    whole = metrics.read_text()
    with open(metrics, "a") as handle:
        handle.write('{"event": "train", "glo')
    with caplog.at_level("WARNING"):
        assert runner.main("torn", *SHORT, "--max-steps", "4", "--resume", "auto") == 0
    assert caplog.text.count("ended in a torn line of 23 bytes (a crash while writing); it is dropped") == 1
    assert metrics.read_text().startswith(whole)
    steps = [event["global_step"] for event in read_metrics(metrics, event="train")]  # every line parses
    assert steps == [1, 2, 3, 4]
