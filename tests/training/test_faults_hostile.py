"""Hostile and awkward input: checkpoints that would run code, and paths with spaces, non-ASCII names and symlinks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import SyntheticData, TrainRunner, load_checkpoint
from tests.helpers import one_error_line, write_trojan_checkpoint


@pytest.fixture
def trojan(tmp_path: Path) -> tuple[Path, Path]:
    """A checkpoint that looks like ours but runs a command when unpickled, and the file that command creates."""
    marker = tmp_path / "code-ran"
    return write_trojan_checkpoint(tmp_path / "trojan.pth", marker), marker


@pytest.mark.parametrize("flag", ["--resume", "--load"])
def test_train_refuses_a_checkpoint_that_would_run_code(
    runner: TrainRunner, trojan: tuple[Path, Path], capsys: pytest.CaptureFixture, flag: str
) -> None:
    path, marker = trojan
    assert runner.main("trojan", "-e", "1", flag, str(path)) == 2
    error = one_error_line(capsys.readouterr().err)
    assert f"refused to load {path}" in error and "could run code" in error
    assert not marker.exists()
    assert not (runner.run_dir("trojan") / "last.pth").exists()


def test_resume_auto_skips_a_checkpoint_that_would_run_code(
    runner: TrainRunner, trojan: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    path, marker = trojan
    assert runner.main("planted", "-e", "1", "--max-steps", "2") == 0
    shutil.copy(path, runner.run_dir("planted") / "INTERRUPTED.pth")  # now the newest file of the folder
    assert runner.main("planted", "-e", "1", "--max-steps", "3", "--resume", "auto") == 0
    assert "skipping" in caplog.text and "INTERRUPTED.pth" in caplog.text and "could run code" in caplog.text
    assert load_checkpoint(runner.run_dir("planted") / "last.pth")["global_step"] == 3
    assert not marker.exists()


def test_predict_refuses_a_checkpoint_that_would_run_code(
    carvana_data: SyntheticData, trojan: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import predict

    path, marker = trojan
    image = next(carvana_data.imgs.iterdir())
    code = predict.main(["-m", str(path), "-i", str(image), "--output-dir", str(tmp_path / "out"), "--no-progress"])
    assert code == 2
    error = one_error_line(capsys.readouterr().err)
    assert f"refused to load {path}" in error
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_the_trojan_is_real(trojan: tuple[Path, Path]) -> None:
    # The refusals above mean something only if loading the file the unsafe way does run the command.
    path, marker = trojan
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_paths_with_spaces_non_ascii_names_and_symlinks(
    carvana_data: SyntheticData, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import predict

    real = tmp_path / "données d'entraînement"
    shutil.copytree(carvana_data.imgs, real / "ïmages")
    shutil.copytree(carvana_data.masks, real / "masques 1")
    linked = tmp_path / "lien vers les données"
    linked.symlink_to(real, target_is_directory=True)
    data = SyntheticData(linked / "ïmages", linked / "masques 1", carvana_data.n_images)
    runner = TrainRunner(data, tmp_path / "points de contrôle")
    exp_name = "essai n° 1 — été"

    assert runner.main(exp_name, "-e", "1", "--max-steps", "2") == 0
    assert runner.main(exp_name, "-e", "1", "--max-steps", "3", "--resume", "auto") == 0
    last = runner.run_dir(exp_name) / "last.pth"
    assert load_checkpoint(last)["global_step"] == 3

    outputs = tmp_path / "sorties à vérifier"
    assert predict.main(["-m", str(last), "-i", str(data.imgs), "--output-dir", str(outputs), "--no-progress"]) == 0
    assert len(list(outputs.glob("*_OUT.png"))) == carvana_data.n_images
    assert "Error" not in capsys.readouterr().err
