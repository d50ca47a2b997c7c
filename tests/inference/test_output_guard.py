"""No output replaces an input, a checkpoint or another output: one Error line naming both paths, nothing written."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

import evaluate as evaluate_cli
import predict
from tests.conftest import REPO_ROOT
from tests.helpers import one_error_line, small_tmpfs, write_images
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


# Outputs are compared with inputs as files (device and inode), not as path strings: links are caught.


def test_an_output_hard_linked_to_the_input_is_refused(tmp_path, images, binary_checkpoint, capsys):
    link = tmp_path / "mask.png"
    os.link(images[0], link)
    before = snapshot(tmp_path)
    assert run_predict("-m", binary_checkpoint, "-i", images[0], "-o", link) == USER_ERROR_EXIT_CODE
    expect_refused(capsys, before, tmp_path, link, "the input")


def test_an_output_symlinked_to_a_sibling_photo_is_refused(tmp_path, images, binary_checkpoint, capsys):
    link = tmp_path / "mask.png"
    link.symlink_to(images[1])  # not an input of this run, but an image in the input folder
    before = snapshot(tmp_path)
    assert run_predict("-m", binary_checkpoint, "-i", images[0], "-o", link) == USER_ERROR_EXIT_CODE
    expect_refused(capsys, before, tmp_path, link, "an existing image in an input folder")


def test_an_output_hard_linked_elsewhere_replaces_the_link_not_the_file(tmp_path, images, binary_checkpoint):
    elsewhere = tmp_path / "keep" / "photo.png"
    elsewhere.parent.mkdir()
    shutil.copy(images[1], elsewhere)
    link = tmp_path / "out" / "mask.png"
    link.parent.mkdir()
    os.link(elsewhere, link)
    kept = hashlib.sha256(elsewhere.read_bytes()).hexdigest()
    assert run_predict("-m", binary_checkpoint, "-i", images[0], "-o", link) == 0
    assert hashlib.sha256(elsewhere.read_bytes()).hexdigest() == kept, "the write went through the hard link"
    assert not os.path.samefile(link, elsewhere)
    assert sorted(path.name for path in link.parent.iterdir()) == ["mask.png"], "a temporary file was left"


@pytest.mark.parametrize("name", ["weights.pt", "scores.json", "model.ckpt"])
def test_evaluate_json_never_replaces_a_checkpoint_under_any_name(
    tmp_path, carvana_data, binary_checkpoint, capsys, name
):
    path = shutil.copy(binary_checkpoint, tmp_path / name)
    before = snapshot(tmp_path)
    argv = ["-m", str(binary_checkpoint), "--imgs", str(carvana_data.imgs), "--masks", str(carvana_data.masks)]
    assert evaluate_cli.main([*argv, "--json", str(path), "--workers", "0", "--no-progress"]) == USER_ERROR_EXIT_CODE
    expect_refused(capsys, before, tmp_path, path, "an existing checkpoint")


def test_evaluate_json_symlinked_to_the_checkpoint_is_refused(tmp_path, carvana_data, binary_checkpoint, capsys):
    link = tmp_path / "scores.json"
    link.symlink_to(binary_checkpoint)
    before = snapshot(tmp_path)
    argv = ["-m", str(binary_checkpoint), "--imgs", str(carvana_data.imgs), "--masks", str(carvana_data.masks)]
    assert evaluate_cli.main([*argv, "--json", str(link), "--workers", "0", "--no-progress"]) == USER_ERROR_EXIT_CODE
    expect_refused(capsys, before, tmp_path, link, "the checkpoint")


def test_evaluate_refuses_one_folder_for_images_and_masks(tmp_path, carvana_data, binary_checkpoint, capsys):
    link = tmp_path / "same"
    link.symlink_to(carvana_data.imgs, target_is_directory=True)
    argv = ["-m", str(binary_checkpoint), "--imgs", str(carvana_data.imgs), "--masks", str(link)]
    assert evaluate_cli.main([*argv, "--workers", "0", "--no-progress"]) == USER_ERROR_EXIT_CODE
    line = one_error_line(capsys.readouterr().err)
    assert "one folder" in line and "--masks" in line, line


@pytest.mark.parametrize("target", ["checkpoint_as_pt", "image"])
def test_export_never_replaces_a_checkpoint_under_another_name_or_an_image(
    tmp_path, images, binary_checkpoint, capsys, target
):
    path = shutil.copy(binary_checkpoint, tmp_path / "weights.pt") if target == "checkpoint_as_pt" else images[0]
    before = snapshot(tmp_path)
    code = run_predict("-m", binary_checkpoint, "--export", "torchscript", path, "--export-size", "32x32")
    assert code == USER_ERROR_EXIT_CODE
    expect_refused(capsys, before, tmp_path, path)


def export(path: Path, checkpoint: Path, *extra: object) -> int:
    return run_predict("-m", checkpoint, "--export", "torchscript", path, "--export-size", "32x32", *extra)


def test_export_replaces_an_earlier_export_only_with_overwrite(tmp_path, binary_checkpoint, capsys):
    path = tmp_path / "model.pt"
    assert export(path, binary_checkpoint) == 0
    first = path.stat().st_ino
    capsys.readouterr()
    before = snapshot(tmp_path)
    assert export(path, binary_checkpoint) == USER_ERROR_EXIT_CODE
    expect_refused(capsys, before, tmp_path, path, "--overwrite")
    assert export(path, binary_checkpoint, "--overwrite") == 0
    assert path.stat().st_ino != first, "the second export was not written"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("export_format", ["onnx", "torchscript"])
def test_export_never_replaces_an_existing_file_without_overwrite(tmp_path, binary_checkpoint, capsys, export_format):
    path = tmp_path / "notes.onnx"
    path.write_text("my notes")
    before = snapshot(tmp_path)
    code = run_predict("-m", binary_checkpoint, "--export", export_format, path, "--export-size", "32x32")
    assert code == USER_ERROR_EXIT_CODE
    expect_refused(capsys, before, tmp_path, path, "--overwrite")


@pytest.mark.parametrize("name", ["metrics.jsonl", "split.json", "config.yaml", "tensorboard/events.out"])
@pytest.mark.parametrize("through", ["path", "link"])
@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]], ids=["plain", "overwrite"])
def test_export_never_replaces_a_training_run_file_even_with_overwrite(
    tmp_path, binary_checkpoint, capsys, name, through, overwrite
):
    run = tmp_path / "run"
    (run / "tensorboard").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"event": "train", "global_step": 1}\n')
    (run / name).write_text("kept\n") if name != "metrics.jsonl" else None
    path = run / name
    if through == "link":
        path = tmp_path / "model.pt"
        path.symlink_to(run / name)
    before = snapshot(tmp_path)
    assert export(path, binary_checkpoint, *overwrite) == USER_ERROR_EXIT_CODE
    expect_refused(capsys, before, tmp_path, path, "training run")


def test_export_never_replaces_an_input_image_even_with_overwrite(tmp_path, images, binary_checkpoint, capsys):
    before = snapshot(tmp_path)
    assert export(images[0], binary_checkpoint, "-i", images[0], "--overwrite") == USER_ERROR_EXIT_CODE
    expect_refused(capsys, before, tmp_path, images[0])


def test_export_may_write_a_new_file_into_a_run_folder(tmp_path, binary_checkpoint):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"event": "train", "global_step": 1}\n')
    assert export(run / "model.pt", binary_checkpoint) == 0
    assert export(run / "model.pt", binary_checkpoint, "--overwrite") == 0


def test_predict_into_a_full_disk_with_workers_stops_with_one_line(tmp_path, binary_checkpoint):
    """A full output disk ends predict (exit 2, one Error line) with loader workers running; the previous output is
    left whole and no temporary file behind. A timeout turns a hang into a failure."""
    photos = write_images(tmp_path / "in", [(128, 128)] * 12)
    with small_tmpfs(tmp_path / "small", "64k") as out:
        previous = out / f"{photos[0].stem}_OUT.png"
        previous.write_bytes(b"previous good output")
        command = [sys.executable, "predict.py", "-m", str(binary_checkpoint), "-i", str(photos[0].parent)]
        command += ["--output-dir", str(out), "--viz", "--workers", "1", "--no-progress"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
        assert result.returncode == USER_ERROR_EXIT_CODE, result.stderr
        line = one_error_line(result.stderr)
        assert "No space left on device" in line and str(out) in line, line
        assert not [path.name for path in out.iterdir() if path.name.startswith(".")], "a temporary file was left"
        if previous.read_bytes() != b"previous good output":  # replaced by a complete mask, or left as it was
            with Image.open(previous) as mask:
                mask.load()
