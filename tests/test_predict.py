"""predict.py end to end, in-process: inputs, outputs, checkpoint formats, mask values, errors and exit codes.

Also home of the helpers the other predict/evaluate/export tests import (tiny models, checkpoints, images).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import predict
from unet import UNet
from utils.data_loading import image_tensor
from utils.errors import USER_ERROR_EXIT_CODE

REPO_ROOT = Path(__file__).resolve().parent.parent
MIXED_SIZES = [(48, 32), (64, 48), (48, 32), (56, 40)]


# ---------------------------------------------------------------------------------------------------------- helpers


def structured_image(width: int, height: int, seed: int = 0) -> np.ndarray:
    """RGB uint8 pixels with smooth shapes, so an untrained model predicts regions rather than noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    phase = rng.uniform(0, 6, size=3)
    channels = [np.sin(7 * x + 3 * y + phase[0]), np.cos(5 * y - 2 * x + phase[1]), np.sin(9 * x * y + phase[2])]
    return ((np.stack(channels, axis=-1) * 0.5 + 0.5) * 255).astype(np.uint8)


def write_images(folder: Path, sizes: Sequence[tuple[int, int]], ext: str = ".png", seed: int = 0) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, (width, height) in enumerate(sizes):
        path = folder / f"img{index:02d}{ext}"
        Image.fromarray(structured_image(width, height, seed + index)).save(path)
        paths.append(path)
    return paths


@torch.no_grad()
def make_model(n_classes: int = 2, *, bilinear: bool = False, seed: int = 0) -> UNet:
    """An untrained tiny UNet whose output bias is set so that every class wins on part of a test image."""
    torch.manual_seed(seed)
    model = UNet(3, n_classes, bilinear=bilinear, base_channels=8).eval()
    logits = model(torch.from_numpy(structured_image(64, 48, seed=99)).permute(2, 0, 1)[None].float() / 255)
    if n_classes == 1:
        model.outc.conv.bias -= logits.median()
    else:
        model.outc.conv.bias -= logits.mean(dim=(0, 2, 3))
    return model


def save_checkpoint(path: Path, model: UNet, mask_values: list | None, style: str = "ours") -> Path:
    """Our format, milesial's (bare state_dict + 'mask_values') or a DDP script's ('module.' prefixes)."""
    state = model.state_dict()
    if style == "ours":
        payload = {"format_version": 1, "model_state": state, "model_args": model.constructor_args()}
    elif style == "milesial":
        payload = dict(state)
    elif style == "ddp":
        payload = {f"module.{key}": value for key, value in state.items()}
    else:
        raise ValueError(style)
    if mask_values is not None:
        payload["mask_values"] = mask_values
    torch.save(payload, path)
    return path


@torch.inference_mode()
def reference_classes(model: UNet, path: Path, scale: float, threshold: float = 0.5) -> np.ndarray:
    """milesial's predict_img, one image at a time: resize, forward, logits to the original size, decide."""
    image = Image.open(path)
    logits = model(image_tensor(image, scale)[None])
    logits = F.interpolate(logits, (image.height, image.width), mode="bilinear")
    if model.n_classes == 1:
        return (torch.sigmoid(logits[0, 0]) > threshold).numpy().astype(np.uint8)
    return logits[0].argmax(dim=0).numpy().astype(np.uint8)


def read_classes(path: Path, mask_values: list) -> np.ndarray:
    """Class indices of a written mask, by looking each pixel's value up in ``mask_values``."""
    pixels = np.asarray(Image.open(path))
    if pixels.dtype == bool:
        pixels = pixels.astype(np.int64)
    classes = np.full(pixels.shape[:2], -1, dtype=np.int64)
    for index, value in enumerate(mask_values):
        match = np.all(pixels == np.asarray(value), axis=-1) if pixels.ndim == 3 else pixels == value
        classes[match] = index
    assert (classes >= 0).all(), "the mask holds values that are not mask_values"
    return classes


def run_predict(*args: str | Path) -> int:
    """predict.main in this process, without progress bar and (unless asked) without worker processes."""
    argv = [str(arg) for arg in args]
    if "--workers" not in argv and "-j" not in argv:
        argv += ["--workers", "0"]
    return predict.main([*argv, "--no-progress"])


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from threads, and on a busy machine two OpenMP threads made these tests 3x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def images(tmp_path: Path) -> list[Path]:
    return write_images(tmp_path / "in", MIXED_SIZES)


@pytest.fixture
def binary_checkpoint(tmp_path: Path) -> Path:
    return save_checkpoint(tmp_path / "model.pth", make_model(2), [0, 1])


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


def test_viz_writes_an_overlay_and_no_save_skips_the_mask(tmp_path, images, binary_checkpoint):
    out_dir = tmp_path / "out"
    assert run_predict("-m", binary_checkpoint, "-i", images[1], "--output-dir", out_dir, "-v", "-n") == 0
    viz = Image.open(out_dir / f"{images[1].stem}_VIZ.png")
    assert viz.mode == "RGB" and viz.size == (64, 48)
    assert not (out_dir / f"{images[1].stem}_OUT.png").exists()
    # The overlay differs from the image where class 1 was predicted, and only there.
    original = np.asarray(Image.open(images[1])).astype(int)
    changed = np.any(np.asarray(viz).astype(int) != original, axis=-1)
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
    assert viz.shape == (48, 2 * 64 + 8, 3)
    original = np.asarray(Image.open(images[1])).astype(int)
    truth_changed = np.any(viz[:, :64] != original, axis=-1)
    # Labels are drawn in the top-left corner; below them the left half shows exactly the true mask.
    np.testing.assert_array_equal(truth_changed[16:], truth[16:] == 1)
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
    assert f"cannot read image {grey}: it has 1 channel(s) but the model expects 3" in caplog.text
    for path in images:
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
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("Error: ") and message in err[-1] and str(model_file) in err[-1]


def test_an_output_folder_that_cannot_be_written_is_one_clear_error(tmp_path, images, binary_checkpoint, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("a file where a folder should be")
    code = run_predict("-m", binary_checkpoint, "-i", images[0], "--output-dir", blocker / "out")
    assert code == USER_ERROR_EXIT_CODE
    assert "cannot write outputs to" in capsys.readouterr().err
    assert not images[0].with_name(f"{images[0].stem}_OUT.png").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["-o", "a.png", "b.png"], "--output got 2 paths for 1 input images"),
        (["-o", "a.jpg"], "masks must be lossless"),
        (["--tile", "50"], "--tile 50"),
        (["--scale", "0"], "--scale 0.0"),
        (["--device", "cuda:7"] if not torch.cuda.is_available() else ["--device", "nonsense"], "--device"),
        (["-n"], "--no-save with no --viz"),
        (["--classes", "3"], "--classes asks for 3"),
    ],
)
def test_bad_flags_are_one_clear_error(tmp_path, images, binary_checkpoint, capsys, extra, message):
    assert run_predict("-m", binary_checkpoint, "-i", images[0], *extra) == USER_ERROR_EXIT_CODE
    assert message in capsys.readouterr().err


def test_output_flag_with_a_folder_input_asks_for_output_dir(tmp_path, images, binary_checkpoint, capsys):
    code = run_predict("-m", binary_checkpoint, "-i", images[0].parent, "-o", *(["x.png"] * len(images)))
    assert code == USER_ERROR_EXIT_CODE
    assert "use --output-dir" in capsys.readouterr().err


def test_missing_input_is_one_clear_error(tmp_path, binary_checkpoint, capsys):
    assert run_predict("-m", binary_checkpoint, "-i", tmp_path / "nope.png") == USER_ERROR_EXIT_CODE
    assert "no such file or folder" in capsys.readouterr().err


def test_two_inputs_writing_the_same_output_is_refused(tmp_path, binary_checkpoint, capsys):
    write_images(tmp_path / "a", [(48, 32)])
    write_images(tmp_path / "b", [(48, 32)])
    code = run_predict("-m", binary_checkpoint, "-i", tmp_path / "a", tmp_path / "b", "--output-dir", tmp_path / "out")
    assert code == USER_ERROR_EXIT_CODE
    assert "would both be written to" in capsys.readouterr().err


def test_command_line_exit_status_and_one_line_error(tmp_path):
    result = subprocess.run(
        [sys.executable, "predict.py", "-m", tmp_path / "missing.pth", "-i", tmp_path / "x.png"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == USER_ERROR_EXIT_CODE
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: checkpoint") and "missing.pth" in lines[0]
