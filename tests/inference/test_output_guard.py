"""No output replaces an input, a checkpoint or another output: one Error line naming both paths, nothing written."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

import evaluate as evaluate_cli
import predict
from tests.helpers import one_error_line, write_images
from utils.errors import USER_ERROR_EXIT_CODE


def run_predict(*args) -> int:
    return predict.main([*(str(arg) for arg in args), "--workers", "0", "--no-progress"])


def snapshot(folder: Path) -> dict[str, str]:
    files = sorted(path for path in folder.rglob("*") if path.is_file())
    return {str(path): hashlib.sha256(path.read_bytes()).hexdigest() for path in files}


def expect_refused(capsys, before: dict[str, str], root: Path, *names: object) -> None:
    line = one_error_line(capsys.readouterr().err)
    for name in names:
        assert str(name) in line, line
    assert snapshot(root) == before, "something was written or changed"


def test_an_output_list_naming_another_input_is_refused(tmp_path, images, binary_checkpoint, capsys):
    before = snapshot(tmp_path)
    code = run_predict("-m", binary_checkpoint, "-i", images[0], images[1], "-o", images[1], tmp_path / "x.png")
    assert code == USER_ERROR_EXIT_CODE
    expect_refused(capsys, before, tmp_path, images[1], f"the mask of {images[0]}")


def test_a_default_mask_name_that_is_another_input_is_refused(tmp_path, binary_checkpoint, capsys):
    first, second = write_images(tmp_path / "in", [(48, 32), (48, 32)])
    second = second.rename(first.with_name(f"{first.stem}_OUT.png"))
    before = snapshot(tmp_path)
    assert run_predict("-m", binary_checkpoint, "-i", first, second) == USER_ERROR_EXIT_CODE
    expect_refused(capsys, before, tmp_path, second, f"the mask of {first}")


def test_an_overlay_over_an_input_is_refused(tmp_path, binary_checkpoint, capsys):
    first, second = write_images(tmp_path / "in", [(48, 32), (48, 32)])
    second = second.rename(first.with_name(f"{first.stem}_VIZ.png"))
    before = snapshot(tmp_path)
    assert run_predict("-m", binary_checkpoint, "-i", first, second, "--viz", "-n") == USER_ERROR_EXIT_CODE
    expect_refused(capsys, before, tmp_path, second, f"the overlay of {first}")


def test_an_output_over_a_true_mask_of_viz_is_refused(tmp_path, images, binary_checkpoint, capsys):
    masks = tmp_path / "masks"
    masks.mkdir()
    shutil.copy(images[1], masks / f"{images[1].stem}_OUT.png")
    before = snapshot(tmp_path)
    code = run_predict("-m", binary_checkpoint, "-i", images[1], "--output-dir", masks, "--viz", "--masks", masks)
    assert code == USER_ERROR_EXIT_CODE
    expect_refused(capsys, before, tmp_path, masks / f"{images[1].stem}_OUT.png", "a true mask in --masks")


def test_two_inputs_writing_one_file_are_refused(tmp_path, binary_checkpoint, capsys):
    [first] = write_images(tmp_path / "a", [(48, 32)])
    [second] = write_images(tmp_path / "b", [(48, 32)])
    before = snapshot(tmp_path)
    code = run_predict("-m", binary_checkpoint, "-i", first, second, "--output-dir", tmp_path / "out")
    assert code == USER_ERROR_EXIT_CODE
    expect_refused(capsys, before, tmp_path, first, second, tmp_path / "out" / f"{first.stem}_OUT.png")


@pytest.mark.parametrize("target", ["checkpoint", "other_checkpoint"])
def test_export_never_replaces_a_checkpoint(tmp_path, binary_checkpoint, capsys, target):
    path = binary_checkpoint if target == "checkpoint" else shutil.copy(binary_checkpoint, tmp_path / "other.pth")
    before = snapshot(tmp_path)
    assert run_predict("-m", binary_checkpoint, "--export", "torchscript", path) == USER_ERROR_EXIT_CODE
    expect_refused(capsys, before, tmp_path, path)


@pytest.mark.parametrize("target", ["image", "mask", "checkpoint"])
def test_evaluate_json_never_replaces_an_input_or_a_checkpoint(
    tmp_path, carvana_data, binary_checkpoint, capsys, target
):
    imgs, masks = tmp_path / "imgs", tmp_path / "masks"
    shutil.copytree(carvana_data.imgs, imgs)
    shutil.copytree(carvana_data.masks, masks)
    path = {"image": sorted(imgs.iterdir())[0], "mask": sorted(masks.iterdir())[0], "checkpoint": binary_checkpoint}
    before = snapshot(tmp_path)
    argv = ["-m", str(binary_checkpoint), "--imgs", str(imgs), "--masks", str(masks), "--json", str(path[target])]
    assert evaluate_cli.main([*argv, "--workers", "0", "--no-progress"]) == USER_ERROR_EXIT_CODE
    expect_refused(capsys, before, tmp_path, path[target], "--json")
