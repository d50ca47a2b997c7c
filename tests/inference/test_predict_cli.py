"""predict.py end to end, in-process: inputs, outputs, checkpoint formats, mask values, errors and exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import predict
from tests.conftest import REPO_ROOT
from tests.helpers import make_model, one_error_line, read_classes, reference_classes, save_checkpoint, write_images
from utils.errors import USER_ERROR_EXIT_CODE


def run_predict(*args: str | Path) -> int:
    """predict.main in this process, without progress bar and (unless asked) without worker processes."""
    argv = [str(arg) for arg in args]
    if "--workers" not in argv and "-j" not in argv:
        argv += ["--workers", "0"]
    return predict.main([*argv, "--no-progress"])


# ------------------------------------------------------------------------------------------------------------ tests


def test_folder_input_writes_one_mask_per_image_beside_it_matching_single_image_prediction(tmp_path, images):
    model = make_model(2)
    checkpoint = save_checkpoint(tmp_path / "model.pth", model, [0, 1])
    assert run_predict("-m", checkpoint, "-i", images[0].parent, "-s", "0.5", "--batch-size", "4") == 0
    for path in images:
        output = path.with_name(f"{path.stem}_OUT.png")
        written = Image.open(output)
        # Carvana's 0/1 values: a 1-bit PNG at the original size.
        assert written.mode == "1" and written.size == Image.open(path).size
        expected = reference_classes(model, path, 0.5)
        assert 0.05 < expected.mean() < 0.95, "degenerate test model"
        np.testing.assert_array_equal(read_classes(output, [0, 1]), expected)


def test_batches_with_worker_processes_give_the_same_masks_as_one_at_a_time(tmp_path, images, binary_checkpoint):
    one, many = tmp_path / "one", tmp_path / "many"
    assert run_predict("-m", binary_checkpoint, "-i", images[0].parent, "--output-dir", one, "-b", "1") == 0
    assert run_predict("-m", binary_checkpoint, "-i", images[0].parent, "--output-dir", many, "-b", "3", "-j", "2") == 0
    for path in images:
        np.testing.assert_array_equal(
            np.asarray(Image.open(one / f"{path.stem}_OUT.png")), np.asarray(Image.open(many / f"{path.stem}_OUT.png"))
        )


@pytest.mark.parametrize("style", ["ours", "milesial", "ddp"])
def test_every_checkpoint_format_writes_the_original_mask_values(tmp_path, images, style):
    model = make_model(2)
    checkpoint = save_checkpoint(tmp_path / f"{style}.pth", model, [0, 255], style=style)
    out_dir = tmp_path / "out"
    assert run_predict("-m", checkpoint, "-i", images[1], "--output-dir", out_dir) == 0
    written = Image.open(out_dir / f"{images[1].stem}_OUT.png")
    assert written.mode == "L"
    assert set(np.unique(np.asarray(written)).tolist()) == {0, 255}
    np.testing.assert_array_equal(
        read_classes(out_dir / f"{images[1].stem}_OUT.png", [0, 255]), reference_classes(model, images[1], 0.5)
    )


def test_colour_mask_values_are_written_as_rgb(tmp_path, images):
    colours = [[0, 0, 0], [255, 0, 0], [0, 0, 255]]
    model = make_model(3)
    checkpoint = save_checkpoint(tmp_path / "m.pth", model, colours)
    output = tmp_path / "mask.png"
    assert run_predict("-m", checkpoint, "-i", images[1], "-o", output, "-s", "1") == 0
    assert Image.open(output).mode == "RGB"
    classes = read_classes(output, colours)
    np.testing.assert_array_equal(classes, reference_classes(model, images[1], 1.0))
    assert len(np.unique(classes)) == 3


def test_checkpoint_without_mask_values_falls_back_to_milesial_defaults(tmp_path, images):
    checkpoint = save_checkpoint(tmp_path / "m.pth", make_model(2), None, style="milesial")
    output = tmp_path / "mask.png"
    assert run_predict("-m", checkpoint, "-i", images[0], "-o", output) == 0
    assert Image.open(output).mode == "1"


@pytest.mark.parametrize(("threshold", "expected"), [("0.0", 1), ("1.0", 0)])
def test_mask_threshold_decides_one_logit_models(tmp_path, images, threshold, expected):
    checkpoint = save_checkpoint(tmp_path / "m.pth", make_model(1), [0, 1])
    output = tmp_path / "mask.png"
    assert run_predict("-m", checkpoint, "-i", images[0], "-o", output, "-t", threshold) == 0
    assert np.all(np.asarray(Image.open(output)) == expected)


def test_default_threshold_matches_the_reference_for_one_logit_models(tmp_path, images):
    model = make_model(1)
    checkpoint = save_checkpoint(tmp_path / "m.pth", model, [0, 1])
    output = tmp_path / "mask.png"
    assert run_predict("-m", checkpoint, "-i", images[3], "-o", output) == 0
    expected = reference_classes(model, images[3], 0.5)
    assert 0.05 < expected.mean() < 0.95
    np.testing.assert_array_equal(read_classes(output, [0, 1]), expected)


def test_explicit_outputs_pair_with_input_files(tmp_path, images, binary_checkpoint):
    outputs = [tmp_path / "a.png", tmp_path / "sub" / "b.png"]
    assert run_predict("-m", binary_checkpoint, "-i", images[0], images[1], "-o", *outputs) == 0
    assert Image.open(outputs[0]).size == (48, 32) and Image.open(outputs[1]).size == (64, 48)


def test_glob_input_skips_earlier_outputs(tmp_path, images, binary_checkpoint):
    pattern = images[0].parent / "*.png"
    assert run_predict("-m", binary_checkpoint, "-i", pattern) == 0
    assert run_predict("-m", binary_checkpoint, "-i", pattern) == 0
    assert not list(images[0].parent.glob("*_OUT_OUT.png"))
    assert len(list(images[0].parent.glob("*_OUT.png"))) == len(images)


@pytest.mark.parametrize("kind", ["loop", "dangling"])
def test_a_bad_link_in_an_input_folder_is_one_line_naming_it(tmp_path, images, binary_checkpoint, capsys, kind):
    # The folder index train.py and evaluate.py read through: the link is named, not silently left out.
    link = images[0].parent / "zz.png"
    link.symlink_to(link.name if kind == "loop" else tmp_path / "gone.png")
    assert run_predict("-m", binary_checkpoint, "-i", images[0].parent) == USER_ERROR_EXIT_CODE
    line = one_error_line(capsys.readouterr().err)
    assert f"1 link(s) in input image folder {images[0].parent} lead to no file: zz.png" in line, line
    assert not list(images[0].parent.glob("*_OUT.png"))


def test_viz_writes_an_overlay_and_no_save_skips_the_mask(tmp_path, images, binary_checkpoint):
    out_dir = tmp_path / "out"
    assert run_predict("-m", binary_checkpoint, "-i", images[1], "--output-dir", out_dir, "-v", "-n") == 0
    viz = Image.open(out_dir / f"{images[1].stem}_VIZ.png")
    assert viz.mode == "RGB" and viz.width >= 64 and viz.height > 48  # the caption and legend below the overlay
    assert not (out_dir / f"{images[1].stem}_OUT.png").exists()
    # The overlay differs from the image where class 1 was predicted, and only there.
    original = np.asarray(Image.open(images[1])).astype(int)
    changed = np.any(np.asarray(viz)[:48, :64].astype(int) != original, axis=-1)
    predicted = make_model(2)
    np.testing.assert_array_equal(changed, reference_classes(predicted, images[1], 0.5) == 1)


def test_viz_with_true_masks_puts_truth_and_prediction_side_by_side(tmp_path, images, binary_checkpoint):
    masks = tmp_path / "masks"
    masks.mkdir()
    truth = np.zeros((48, 64), dtype=np.uint8)
    truth[10:30, 5:40] = 1
    mask = Image.fromarray(truth)
    mask.putpalette([0, 0, 0, 255, 255, 255])  # Carvana's GIFs: palette indices 0/1 are the values
    mask.save(masks / f"{images[1].stem}_mask.gif")
    out_dir = tmp_path / "out"
    assert run_predict("-m", binary_checkpoint, "-i", images[1], "--output-dir", out_dir, "-v", "--masks", masks) == 0
    viz = np.asarray(Image.open(out_dir / f"{images[1].stem}_VIZ.png")).astype(int)
    assert viz.shape[0] > 48 and viz.shape[1] >= 2 * 64 + 8
    original = np.asarray(Image.open(images[1])).astype(int)
    truth_changed = np.any(viz[:48, :64] != original, axis=-1)
    # Captions and legend are below the panels: the left panel shows exactly the true mask.
    np.testing.assert_array_equal(truth_changed, truth == 1)
    assert (out_dir / f"{images[1].stem}_OUT.png").exists()


def test_tiling_with_one_window_matches_whole_image_prediction(tmp_path, images, binary_checkpoint):
    whole, tiled = tmp_path / "whole.png", tmp_path / "tiled.png"
    assert run_predict("-m", binary_checkpoint, "-i", images[1], "-o", whole, "-s", "1") == 0
    assert run_predict("-m", binary_checkpoint, "-i", images[1], "-o", tiled, "-s", "1", "--tile", "64") == 0
    np.testing.assert_array_equal(np.asarray(Image.open(whole)), np.asarray(Image.open(tiled)))


def test_tiling_with_several_windows_writes_full_size_masks(tmp_path, binary_checkpoint):
    [large] = write_images(tmp_path / "big", [(160, 112)])
    whole, tiled = tmp_path / "whole.png", tmp_path / "tiled.png"
    assert run_predict("-m", binary_checkpoint, "-i", large, "-o", whole, "-s", "1") == 0
    assert (
        run_predict(
            "-m", binary_checkpoint, "-i", large, "-o", tiled, "-s", "1", "--tile", "64", "--tile-overlap", "0.5"
        )
        == 0
    )
    agreement = (np.asarray(Image.open(whole)) == np.asarray(Image.open(tiled))).mean()
    assert Image.open(tiled).size == (160, 112)
    assert agreement > 0.95


def test_bf16_runs_and_mostly_agrees_with_fp32(tmp_path, images, binary_checkpoint):
    fp32, bf16 = tmp_path / "fp32.png", tmp_path / "bf16.png"
    assert run_predict("-m", binary_checkpoint, "-i", images[1], "-o", fp32) == 0
    assert run_predict("-m", binary_checkpoint, "-i", images[1], "-o", bf16, "--precision", "bf16") == 0
    assert (np.asarray(Image.open(fp32)) == np.asarray(Image.open(bf16))).mean() > 0.8


def test_an_unreadable_image_is_named_the_others_are_written_and_the_exit_is_non_zero(
    tmp_path, images, binary_checkpoint, caplog
):
    broken = images[0].parent / "broken.png"
    broken.write_bytes(b"not an image at all")
    grey = images[0].parent / "grey.png"
    Image.new("L", (40, 40)).save(grey)
    code = run_predict("-m", binary_checkpoint, "-i", images[0].parent, "-j", "1")
    assert code == predict.PARTIAL_FAILURE_EXIT_CODE
    assert f"cannot read image {broken}" in caplog.text
    # A grey photo for an RGB model is converted, not a failure: one warning with the count.
    assert f"cannot read image {grey}" not in caplog.text
    assert [r.getMessage() for r in caplog.records if "converted" in r.getMessage()] == [
        "1 grey image(s) were converted to RGB for the 3-channel model"
    ]
    for path in [*images, grey]:
        assert path.with_name(f"{path.stem}_OUT.png").exists()


def _truncated_checkpoint(path: Path) -> None:
    save_checkpoint(path, make_model(2), [0, 1])
    path.write_bytes(path.read_bytes()[:2000])


@pytest.mark.parametrize(
    ("make_model_file", "message"),
    [
        (lambda path: None, "does not exist"),
        (lambda path: _truncated_checkpoint(path), "corrupt or truncated"),
        (lambda path: torch.save([1, 2, 3], path), "not a checkpoint dictionary"),
        (lambda path: torch.save({"epoch": 3}, path), "not a model checkpoint"),
    ],
    ids=["missing", "corrupt", "list", "no-weights"],
)
def test_a_bad_model_file_is_one_clear_error(tmp_path, images, capsys, make_model_file, message):
    model_file = tmp_path / "model.pth"
    make_model_file(model_file)
    assert run_predict("-m", model_file, "-i", images[0]) == USER_ERROR_EXIT_CODE
    line = one_error_line(capsys.readouterr().err)
    assert message in line and str(model_file) in line


def test_an_output_folder_that_cannot_be_written_is_one_clear_error(tmp_path, images, binary_checkpoint, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("a file where a folder should be")
    code = run_predict("-m", binary_checkpoint, "-i", images[0], "--output-dir", blocker / "out")
    assert code == USER_ERROR_EXIT_CODE
    assert "cannot write outputs to" in one_error_line(capsys.readouterr().err)
    assert not images[0].with_name(f"{images[0].stem}_OUT.png").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["-o", "a.png", "b.png"], "--output got 2 paths for 1 input images"),
        (["-o", "a.jpg"], "masks must be lossless"),
        (["--tile", "50"], "--tile 50"),
        (["--scale", "0"], "--scale must be a finite number in (0, 1], got 0"),
        (["--device", "cuda:7"] if not torch.cuda.is_available() else ["--device", "nonsense"], "--device"),
        (["-n"], "--no-save with no --viz"),
        (["--tile-overlapp", "0.2"], "did you mean --tile-overlap? (see python predict.py --help)"),
        (["--mask-threshold", "2"], "--mask-threshold must be a finite number in [0, 1], got 2"),
        (["--classes", "3"], "--classes asks for 3"),
    ],
)
def test_bad_flags_are_one_clear_error(tmp_path, images, binary_checkpoint, capsys, extra, message):
    assert run_predict("-m", binary_checkpoint, "-i", images[0], *extra) == USER_ERROR_EXIT_CODE
    assert message in one_error_line(capsys.readouterr().err)


def test_output_flag_with_a_folder_input_asks_for_output_dir(tmp_path, images, binary_checkpoint, capsys):
    code = run_predict("-m", binary_checkpoint, "-i", images[0].parent, "-o", *(["x.png"] * len(images)))
    assert code == USER_ERROR_EXIT_CODE
    assert "use --output-dir" in one_error_line(capsys.readouterr().err)


def test_missing_input_is_one_clear_error(tmp_path, binary_checkpoint, capsys):
    assert run_predict("-m", binary_checkpoint, "-i", tmp_path / "nope.png") == USER_ERROR_EXIT_CODE
    assert "no such file or folder" in one_error_line(capsys.readouterr().err)


def test_two_inputs_writing_the_same_output_is_refused(tmp_path, binary_checkpoint, capsys):
    write_images(tmp_path / "a", [(48, 32)])
    write_images(tmp_path / "b", [(48, 32)])
    code = run_predict("-m", binary_checkpoint, "-i", tmp_path / "a", tmp_path / "b", "--output-dir", tmp_path / "out")
    assert code == USER_ERROR_EXIT_CODE
    assert "would both be written to" in one_error_line(capsys.readouterr().err)


def test_command_line_exit_status_and_one_line_error(tmp_path):
    result = subprocess.run(
        [sys.executable, "predict.py", "-m", tmp_path / "missing.pth", "-i", tmp_path / "x.png"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == USER_ERROR_EXIT_CODE
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    line = one_error_line(result.stderr)
    assert line.startswith("Error: checkpoint") and "missing.pth" in line
