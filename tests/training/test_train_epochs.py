"""Epoch numbering of the documented DDP script, progress bars, and tiny images in batches of one (real train.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO_ROOT, SyntheticData, TrainRunner, assert_same_training_state, child_env, load_checkpoint
from tests.helpers import read_metrics, save_checkpoint, tiny_unet

# The runner's data: 16 images, 10 % validation -> 15 training images; batch 2 -> 8 steps per epoch, the last batch
# holding one image.
STEPS_PER_EPOCH = 8


def epochs_of(run_dir: Path, event: str) -> list[int]:
    return sorted({record["epoch"] for record in read_metrics(run_dir, event=event)})


@pytest.mark.slow
def test_the_ddp_scripts_load_start_from_save_every_pattern(
    runner: TrainRunner, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`--load ck.pth --start_from 5 --epochs 3 --save_every 2` trains epochs 5, 6, 7, as the documented script does."""
    weights = save_checkpoint(tmp_path / "ddp_script.pth", tiny_unet(123), None, style="ddp")
    pattern = ["--load", str(weights), "--start_from", "5", "-e", "3", "--save_every", "2", "--log-every", "4"]
    # The script itself, as a user types it.
    result = subprocess.run(
        [sys.executable, "train.py", *runner.args("continued", *pattern)],
        cwd=REPO_ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Starting training: epochs 5..7" in result.stdout
    for number in (5, 6, 7):  # output to a pipe: one log line per epoch instead of a bar
        assert f"epoch {number}/7 done" in result.stdout
    run_dir = runner.run_dir("continued")
    # Epoch-numbered files follow the numbering: 6 is the only multiple of 2 among 5..7.
    assert sorted(p.name for p in run_dir.glob("checkpoint_epoch*.pth")) == ["checkpoint_epoch6.pth"]
    assert load_checkpoint(run_dir / "checkpoint_epoch6.pth")["epoch"] == 6
    last = load_checkpoint(run_dir / "last.pth")
    assert (last["epoch"], last["global_step"]) == (7, 3 * STEPS_PER_EPOCH)
    assert epochs_of(run_dir, "train") == [5, 6, 7] and epochs_of(run_dir, "val") == [5, 6, 7]
    # The cosine is planned for these three epochs and stored in the checkpoint; it ends at zero at the last step.
    plan = {"total_steps": 3 * STEPS_PER_EPOCH, "warmup_steps": 0, "shape": "cosine"}
    assert last["scheduler"]["lr_lambdas"] == [plan]
    assert last["args"]["start_from"] == 5 and last["args"]["epochs"] == 3
    assert read_metrics(run_dir, event="train")[-1]["lr"] == 0.0

    # Stopped part-way through epoch 6, then resumed with other --epochs/--start_from: the run keeps its plan (same
    # epochs, same learning rates) and ends bit-identical to the run that was not interrupted.
    assert runner.main("stopped", *pattern, "--max-steps", str(STEPS_PER_EPOCH + 4)) == 0
    caplog.clear()
    assert runner.main("stopped", "--resume", "auto", "-e", "1", "--save_every", "2", "--log-every", "4") == 0
    assert "--resume continues the run's plan, epochs 5..7" in caplog.text
    assert "this command's --start_from 1 --epochs 1 are ignored" in caplog.text
    stopped = runner.run_dir("stopped")
    assert_same_training_state(run_dir / "last.pth", stopped / "last.pth")
    assert sorted(p.name for p in stopped.glob("checkpoint_epoch*.pth")) == ["checkpoint_epoch6.pth"]
    resumed = load_checkpoint(stopped / "last.pth")
    assert resumed["args"]["epochs"] == 3 and resumed["scheduler"]["lr_lambdas"] == last["scheduler"]["lr_lambdas"]


def bar_frames(stream: str, name: str) -> list[str]:
    """The successive states of the progress bar called ``name`` in a captured stream (tqdm redraws with \\r)."""
    return [frame.strip() for frame in re.split(r"[\r\n]", stream) if frame.startswith(name)]


def test_the_bar_counts_the_images_trained_and_ends_at_100_percent(
    runner: TrainRunner, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Bars are drawn on a terminal only (a log file gets log lines): stand in for one.
    monkeypatch.setattr("utils.training.run_log.stderr_is_terminal", lambda stream: True)
    assert runner.main("bars", "-e", "1", "--log-every", "2") == 0
    err = capsys.readouterr().err
    assert bar_frames(err, "Validation:")  # a bar of its own, after the epoch's
    frames = bar_frames(err, "Epoch 1/1")
    # 15 images trained (the last batch has one), not 8 batches x 2 = 16.
    assert frames and all("/15 [" in frame for frame in frames), frames
    assert re.match(r"Epoch 1/1: 100%\|.*\| 15/15 \[.*img/s, loss=\d+\.\d{4}, lr=\d\.\d\de[-+]\d\d\]$", frames[-1])


@pytest.fixture(scope="module")
def tiny_images(tmp_path_factory: pytest.TempPathFactory) -> SyntheticData:
    """16 images of 20x20 px: four 2x2 poolings would leave a 1x1 bottleneck."""
    from utils.datasets.synthetic import generate_carvana_like

    root = tmp_path_factory.mktemp("tiny")
    generate_carvana_like(root, 16, size=(20, 20), seed=2)
    return SyntheticData(root / "imgs", root / "masks", 16)


def test_tiny_images_in_batches_of_one_train(tiny_images: SyntheticData, tmp_path: Path) -> None:
    runner = TrainRunner(tiny_images, tmp_path)
    assert runner.main("ones", "-b", "1", "-e", "1", "--max-steps", "4") == 0
    assert load_checkpoint(runner.run_dir("ones") / "last.pth")["global_step"] == 4


@pytest.mark.slow
def test_a_last_batch_of_one_tiny_image_trains_and_logs_above_the_bar(
    tiny_images: SyntheticData, tmp_path: Path
) -> None:
    """The real script, stdout and stderr in one stream as a terminal shows them: log lines written while the bar
    is drawn (the step checkpoints) start on a line of their own instead of being glued onto the bar."""
    runner = TrainRunner(tiny_images, tmp_path)
    result = subprocess.run(
        [sys.executable, "train.py", *runner.args("last_one", "-e", "1", "--save-every-steps", "3")],
        cwd=REPO_ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout
    assert load_checkpoint(runner.run_dir("last_one") / "last.pth")["global_step"] == STEPS_PER_EPOCH
    saves = [line for line in result.stdout.split("\n") if "INFO Saved last.pth at step" in line]
    assert len(saves) >= 2
    for line in saves:
        assert re.match(r"\d\d:\d\d:\d\d INFO Saved", line.split("\r")[-1]), repr(line)


def test_without_the_padding_a_one_by_one_bottleneck_cannot_train_a_batch_of_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control: the classic 16 px minimum fails on exactly the inputs the tests above train."""
    import unet.unet_model

    model = tiny_unet(0).train()
    model(torch.rand(1, 3, 20, 20))
    monkeypatch.setattr(unet.unet_model, "MIN_SIDE", 16)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        model(torch.rand(1, 3, 20, 20))
