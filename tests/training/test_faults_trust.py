"""Checkpoints you can trust: separate files, readable modes, tensor digests and finite weights, on real runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO_ROOT, TrainRunner, child_env, load_checkpoint
from tests.helpers import flip_tensor_bytes, one_error_line, save_checkpoint, tiny_unet
from utils.checkpoint.files import save_checkpoint_atomic
from utils.checkpoint.format import KEY_MODEL

# 16 images, 10 % validation: 8 steps per epoch. Epoch 1 saves last/epoch1/best; --max-steps 12 then saves last.pth
# alone, 4 steps into epoch 2 (so an older good state exists for --resume auto to fall back to).
RUN = ["-e", "2", "--max-steps", "12"]


@pytest.fixture
def trained(runner: TrainRunner) -> Path:
    assert runner.main("trusted", *RUN) == 0
    return runner.run_dir("trusted")


def _predict(model: Path, image: Path, output: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "predict.py", *_predict_args(model, image, output)],
        cwd=REPO_ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
    )


def _predict_args(model: Path, image: Path, output: Path) -> list[str]:
    return ["-m", str(model), "-i", str(image), "-o", str(output)]


def test_best_last_and_epoch_files_are_separate_files(
    runner: TrainRunner, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert runner.main("separate", "-e", "2") == 0
    run_dir = runner.run_dir("separate")
    names = ["last.pth", "best.pth", "checkpoint_epoch1.pth", "checkpoint_epoch2.pth"]
    inodes = {(run_dir / name).stat().st_ino for name in names}
    assert len(inodes) == len(names), "every checkpoint name is a file of its own"
    assert (run_dir / "last.pth").read_bytes() == (run_dir / "checkpoint_epoch2.pth").read_bytes()
    before = {name: (run_dir / name).read_bytes() for name in names}

    # Writes into one name in place, as `cp other.pth best.pth` and `torch.save(..., "best.pth")` do.
    other = tmp_path / "other.pth"
    torch.save(tiny_unet(5).state_dict(), other)
    shutil.copyfile(other, run_dir / "best.pth")
    torch.save(tiny_unet(6).state_dict(), run_dir / "checkpoint_epoch1.pth")
    assert (run_dir / "last.pth").read_bytes() == before["last.pth"]
    assert (run_dir / "checkpoint_epoch2.pth").read_bytes() == before["checkpoint_epoch2.pth"]
    # --resume auto still finds the run's state (and skips the two overwritten names).
    caplog.clear()
    assert runner.main("separate", "-e", "2", "--resume", "auto") == 0
    assert "Resuming at epoch 3, step 16" in caplog.text


def test_evaluate_refuses_to_write_its_json_over_a_checkpoint(trained: Path, runner: TrainRunner) -> None:
    before = (trained / "last.pth").read_bytes()
    result = subprocess.run(
        [sys.executable, "evaluate.py", "-m", str(trained / "best.pth"), "--imgs", str(runner.data.imgs),
         "--masks", str(runner.data.masks), "--scale", "1", "--json", str(trained / "last.pth")],
        cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "last.pth" in one_error_line(result.stderr)
    assert (trained / "last.pth").read_bytes() == before


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_checkpoint_files_get_the_mode_the_umask_gives(runner: TrainRunner, umask: int) -> None:
    previous = os.umask(umask)
    try:
        assert runner.main(f"mode{umask:o}", "-e", "1") == 0
    finally:
        os.umask(previous)
    run_dir = runner.run_dir(f"mode{umask:o}")
    for name in ("last.pth", "best.pth", "checkpoint_epoch1.pth"):
        assert (run_dir / name).stat().st_mode & 0o777 == 0o666 & ~umask, name


def _damage(kind: str, path: Path) -> None:
    if kind == "flipped bytes":
        flip_tensor_bytes(path)
    else:  # NaN weights under a valid digest: the file was saved like that
        payload = load_checkpoint(path)
        first = next(iter(payload[KEY_MODEL]))
        payload[KEY_MODEL][first] = torch.full_like(payload[KEY_MODEL][first], float("nan"))
        save_checkpoint_atomic(payload, path)


# One kind runs predict.py as the real script (its exit status and error line); the other, predict.main in this
# process: the same refusal without the seconds of another interpreter start.
@pytest.mark.parametrize(
    ("kind", "message", "predict_process"),
    [("flipped bytes", "differ from what was saved", True), ("nan", "holds NaN or inf weights", False)],
)
def test_a_damaged_checkpoint_is_refused_everywhere_and_skipped_by_resume_auto(
    trained: Path,
    runner: TrainRunner,
    tmp_path: Path,
    kind: str,
    message: str,
    predict_process: bool,
    capsys: pytest.CaptureFixture,
    caplog: pytest.LogCaptureFixture,
) -> None:
    last = trained / "last.pth"
    _damage(kind, last)
    assert torch.load(last, weights_only=True)  # torch itself notices nothing

    args = (last, next(runner.data.imgs.iterdir()), tmp_path / "mask.png")
    capsys.readouterr()
    if predict_process:
        result = _predict(*args)
        code, err = result.returncode, result.stderr
    else:
        import predict

        code, err = predict.main(_predict_args(*args)), capsys.readouterr().err
    assert code == 2
    assert one_error_line(err).startswith(f"Error: checkpoint {last}") and message in err
    assert not (tmp_path / "mask.png").exists()

    capsys.readouterr()
    for flag in ("--load", "--resume"):
        assert runner.main(f"from-{flag[2:]}", "-e", "2", flag, str(last)) == 2
        error = one_error_line(capsys.readouterr().err)
        assert error.startswith(f"Error: checkpoint {last}") and message in error, error

    caplog.clear()
    assert runner.main("trusted", *RUN, "--resume", "auto") == 0
    assert f"skipping {last}" in caplog.text and message in caplog.text
    assert "Resuming at epoch 2, step 8" in caplog.text


@pytest.mark.parametrize("style", ["milesial", "ddp"])
def test_foreign_files_with_nan_weights_are_refused(runner: TrainRunner, tmp_path: Path, style: str, capsys) -> None:
    model = tiny_unet(0)
    with torch.no_grad():
        model.outc.conv.weight[0, 0, 0, 0] = float("inf")
    path = save_checkpoint(tmp_path / f"{style}.pth", model, [0, 1], style=style)
    assert runner.main("foreign", "-e", "1", "--load", str(path)) == 2
    error = one_error_line(capsys.readouterr().err)
    assert f"{path} holds NaN or inf weights" in error and "outc.conv.weight" in error
