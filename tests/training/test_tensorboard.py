"""``--tensorboard``: TensorBoard's own reader finds the metrics.jsonl values; a resumed run continues them."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import read_metrics, tensorboard_reader, tensorboard_scalars

pytest.importorskip("tensorboard")


def _raw_steps(run_dir: Path, tag: str) -> list[int]:
    """Every step written for ``tag`` in the event files, purged or not (the raw record)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    steps = []
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            steps += [event.step for value in event.summary.value if value.tag == tag]
    return steps


def test_the_scalars_and_images_are_those_of_metrics_jsonl(runner) -> None:
    assert runner.main("tb", "--epochs", "2", "--log-every", "1", "--tensorboard", "--batch-size", "4") == 0
    run_dir = runner.run_dir("tb")
    reader = tensorboard_reader(run_dir)
    trained = read_metrics(run_dir, event="train")
    assert tensorboard_scalars(reader, "train/loss") == [
        (event["global_step"], pytest.approx(event["loss"], rel=1e-6)) for event in trained
    ]
    assert tensorboard_scalars(reader, "train/learning_rate") == [
        (event["global_step"], pytest.approx(event["lr"], rel=1e-6)) for event in trained
    ]
    assert [step for step, _ in tensorboard_scalars(reader, "train/images_per_s")] == [
        event["global_step"] for event in trained
    ]
    validated = read_metrics(run_dir, event="val")
    assert len(validated) == 2
    for tag, key in [("val/dice", "dice"), ("val/iou", "iou")]:
        assert tensorboard_scalars(reader, tag) == [
            (event["global_step"], pytest.approx(event[key], rel=1e-6)) for event in validated
        ]
    for index in range(2):
        expected = [
            (event["global_step"], pytest.approx(event["per_class_dice"][index], rel=1e-6)) for event in validated
        ]
        assert tensorboard_scalars(reader, f"val/dice/class_{index}") == expected
    # A few validation images, with their true and predicted masks, at each validation.
    for tag in ("val/image", "val/truth", "val/prediction"):
        images = reader.Images(tag)
        assert [image.step for image in images] == [event["global_step"] for event in validated]
        assert images[0].width == 48 and images[0].height == 32


def test_a_resumed_run_continues_the_step_axis_and_shows_each_step_once(runner) -> None:
    try:
        assert runner.main("tb", "--epochs", "2", "--log-every", "1", "--tensorboard") == 0
        run_dir = runner.run_dir("tb")
        total = read_metrics(run_dir, event="train")[-1]["global_step"]
        # As if the run had died after logging epoch 2 but before saving it: the newest state left is epoch 1's.
        (run_dir / "last.pth").unlink()
        (run_dir / "best.pth").unlink()
        (run_dir / "checkpoint_epoch2.pth").unlink()
        resumed_from = torch.load(run_dir / "checkpoint_epoch1.pth", weights_only=True)["global_step"]
        assert 0 < resumed_from < total
        # The resumed run logs every 2nd step only: a step of the first run past the resume point that still showed
        # would be an odd step there.
        assert runner.main("tb", "--epochs", "2", "--log-every", "2", "--tensorboard", "--resume", "auto") == 0
    finally:
        torch.use_deterministic_algorithms(False)

    reader = tensorboard_reader(run_dir)
    shown = tensorboard_scalars(reader, "train/loss")
    trained = read_metrics(run_dir, event="train")  # appended to: the first run's events, then the resumed run's
    first_run, resumed_run = trained[:total], trained[total:]
    assert [event["global_step"] for event in first_run] == list(range(1, total + 1))
    resumed_steps = [event["global_step"] for event in resumed_run]
    assert 0 < len(resumed_steps) < total - resumed_from  # some steps past the resume point are not logged again
    # Each step once, in order: the first run's up to the resume point, then the resumed run's, with its values.
    assert [step for step, _ in shown] == list(range(1, resumed_from + 1)) + resumed_steps
    assert [value for step, value in shown if step > resumed_from] == [
        pytest.approx(event["loss"], rel=1e-6) for event in resumed_run
    ]
    assert [step for step, _ in tensorboard_scalars(reader, "val/dice")][-1] == total
    # The control: the first run's steps past the resume point are still in its file; TensorBoard hides them.
    assert resumed_from + 1 in _raw_steps(run_dir, "train/loss")


# Under DDP only global rank 0 writes events: tested on the DDP run of
# tests/training/test_train_messages.py::test_a_ddp_run_warns_logs_and_writes_tensorboard_events_from_rank_0_only.


# A side output never ends a run nor writes outside the run folder: each case is one warning, the run trains on.


def _run_dir_with(runner, make) -> Path:
    run_dir = runner.run_dir("tb")
    run_dir.mkdir(parents=True)
    make(run_dir / "tensorboard")
    return run_dir


def test_a_linked_tensorboard_folder_is_not_followed(runner, tmp_path, caplog) -> None:
    elsewhere = tmp_path / "inputs"
    elsewhere.mkdir()
    run_dir = _run_dir_with(runner, lambda folder: folder.symlink_to(elsewhere, target_is_directory=True))
    assert runner.main("tb", "--epochs", "1", "--tensorboard") == 0
    assert list(elsewhere.iterdir()) == [], "events were written through the link"
    warnings = [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "--tensorboard" in r.getMessage()
    ]
    assert len(warnings) == 1 and "is a link to" in warnings[0] and "remove the link" in warnings[0], warnings
    assert (run_dir / "last.pth").is_file()


def test_a_file_in_the_way_of_the_tensorboard_folder_is_named(runner, caplog) -> None:
    run_dir = _run_dir_with(runner, lambda folder: folder.write_text("notes"))
    assert runner.main("tb", "--epochs", "1", "--tensorboard") == 0
    assert (run_dir / "tensorboard").read_text() == "notes"
    assert f"{run_dir / 'tensorboard'} is a file, not a folder" in caplog.text
    assert (run_dir / "last.pth").is_file()


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # no writer-thread traceback
def test_an_unwritable_tensorboard_folder_is_one_warning(runner, caplog) -> None:
    from tests.helpers import small_tmpfs

    run_dir = runner.run_dir("tb")
    with small_tmpfs(run_dir / "tensorboard", "1m") as folder:
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)  # root ignores chmod
        assert runner.main("tb", "--epochs", "1", "--tensorboard") == 0
    assert caplog.text.count("cannot write --tensorboard") == 1, caplog.text
    assert (run_dir / "last.pth").is_file()


def test_a_full_disk_at_the_start_of_tensorboard_is_one_warning(runner) -> None:
    from tests.helpers import fill_disk, small_tmpfs

    run_dir = runner.run_dir("tb")
    with small_tmpfs(run_dir / "tensorboard", "64k") as folder:
        fill_disk(folder)
        process = runner.popen([sys.executable], "tb", "--epochs", "1", "--tensorboard", "--no-progress")
        out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err
    assert "Traceback" not in out + err, err
    assert (out + err).count("No space left on device") == 1, out + err
    assert (run_dir / "last.pth").is_file()


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # no writer-thread traceback
def test_a_disk_that_fills_during_the_run_is_one_warning_and_the_run_goes_on(runner, caplog) -> None:
    """A real 8 KiB filesystem for the events: the writer starts (its probe and the file's header fit), the disk
    fills while it writes the steps' scalars and validation images; one warning, and the run trains to its end."""
    from tests.helpers import small_tmpfs

    run_dir = runner.run_dir("tb")
    with small_tmpfs(run_dir / "tensorboard", "8k") as folder:
        assert runner.main("tb", "--epochs", "2", "--log-every", "1", "--tensorboard") == 0
        written = sum(path.stat().st_size for path in folder.glob("events.out.tfevents.*"))
    assert written > 4096, "the writer never got going: the disk was full at the start, not during the run"
    assert caplog.text.count("training continues without --tensorboard") == 1, caplog.text
    assert "No space left on device" in caplog.text
    assert [event["epoch"] for event in read_metrics(run_dir, event="val")] == [1, 2]
    assert (run_dir / "checkpoint_epoch2.pth").is_file()
