"""The checkpoint decides how images are prepared (scale, channels), in predict.py, evaluate.py and hubconf.py."""

from __future__ import annotations

import json
import logging

import numpy as np
from PIL import Image

import evaluate as evaluate_cli
import hubconf
import predict
from tests.helpers import make_model, read_classes, reference_classes, save_checkpoint, save_checkpoint_trained_at
from utils.checkpoint.model import DEFAULT_SCALE, load_model, resolve_scale


def run_predict(*args) -> int:
    return predict.main([*(str(arg) for arg in args), "--workers", "0", "--no-progress"])


def scale_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "trained at" in r.getMessage()]


def test_spec_records_the_training_scale_and_files_without_it_keep_milesials_default(tmp_path):
    model = make_model(2)
    _, ours = load_model(save_checkpoint_trained_at(tmp_path / "ours.pth", model, 0.25))
    assert ours.inference.scale == 0.25 and ours.scale == 0.25
    for style in ("milesial", "ddp"):
        _, foreign = load_model(save_checkpoint(tmp_path / f"{style}.pth", model, [0, 1], style=style))
        assert foreign.inference.scale is None and foreign.scale == DEFAULT_SCALE == 0.5


def test_resolve_scale_warns_once_naming_both_values_when_the_flag_differs(tmp_path, caplog):
    _, spec = load_model(save_checkpoint_trained_at(tmp_path / "m.pth", make_model(2), 0.25))
    with caplog.at_level(logging.INFO):
        assert resolve_scale(spec, None, "m.pth") == 0.25
        assert resolve_scale(spec, 0.25, "m.pth") == 0.25
        assert scale_warnings(caplog) == []
        assert resolve_scale(spec, 0.5, "m.pth") == 0.5
    [warning] = scale_warnings(caplog)
    assert "--scale 0.5" in warning and "(0.25)" in warning


def test_predict_without_scale_uses_the_checkpoints_and_an_explicit_different_one_with_a_warning(
    tmp_path, images, caplog
):
    model = make_model(2)
    checkpoint = save_checkpoint_trained_at(tmp_path / "m.pth", model, 0.25)
    default, explicit = tmp_path / "default.png", tmp_path / "explicit.png"
    with caplog.at_level(logging.INFO):
        assert run_predict("-m", checkpoint, "-i", images[1], "-o", default) == 0
        assert scale_warnings(caplog) == []
        assert run_predict("-m", checkpoint, "-i", images[1], "-o", explicit, "-s", "0.5") == 0
    np.testing.assert_array_equal(read_classes(default, [0, 1]), reference_classes(model, images[1], 0.25))
    np.testing.assert_array_equal(read_classes(explicit, [0, 1]), reference_classes(model, images[1], 0.5))
    # The two scales really give different masks, so the comparison above tells them apart.
    assert not np.array_equal(reference_classes(model, images[1], 0.25), reference_classes(model, images[1], 0.5))
    [warning] = scale_warnings(caplog)
    assert "0.5" in warning and "0.25" in warning


def test_predict_on_a_milesial_checkpoint_keeps_scale_half(tmp_path, images):
    model = make_model(2)
    checkpoint = save_checkpoint(tmp_path / "m.pth", model, [0, 1], style="milesial")
    output = tmp_path / "out.png"
    assert run_predict("-m", checkpoint, "-i", images[1], "-o", output) == 0
    np.testing.assert_array_equal(read_classes(output, [0, 1]), reference_classes(model, images[1], 0.5))


def test_evaluate_without_scale_uses_the_checkpoints(tmp_path, carvana_data, caplog):
    checkpoint = save_checkpoint_trained_at(tmp_path / "m.pth", make_model(2), 0.5)
    reports = {}
    with caplog.at_level(logging.INFO):
        for name, extra in (("default", []), ("explicit", ["-s", "1"])):
            reports[name] = tmp_path / f"{name}.json"
            argv = ["-m", str(checkpoint), "--imgs", str(carvana_data.imgs), "--masks", str(carvana_data.masks)]
            argv += [*extra, "--json", str(reports[name]), "--workers", "0", "--no-progress"]
            assert evaluate_cli.main(argv) == 0
    assert json.loads(reports["default"].read_text())["scale"] == 0.5
    assert json.loads(reports["explicit"].read_text())["scale"] == 1.0
    [warning] = scale_warnings(caplog)
    assert "--scale 1.0" in warning and "(0.5)" in warning


def test_hub_model_carries_its_spec_and_scale(tmp_path):
    model = make_model(2)
    loaded = hubconf.unet(checkpoint=save_checkpoint_trained_at(tmp_path / "m.pth", model, 0.25, [0, 255]))
    assert loaded.scale == 0.25 and loaded.mask_values == [0, 255] and loaded.spec.inference.scale == 0.25
    milesial = hubconf.unet(checkpoint=save_checkpoint(tmp_path / "w.pth", model, [0, 1], style="milesial"))
    assert milesial.scale == 0.5


def test_grey_photos_for_an_rgb_model_are_converted_in_predict_and_evaluate_with_one_warning(
    tmp_path, carvana_data, caplog
):
    imgs, masks = tmp_path / "imgs", tmp_path / "masks"
    imgs.mkdir()
    masks.mkdir()
    for index, path in enumerate(sorted(carvana_data.imgs.iterdir())[:4]):
        image = Image.open(path)
        (image.convert("L") if index % 2 else image.convert("RGB")).save(imgs / f"{path.stem}.png")
        Image.open(carvana_data.masks / f"{path.stem}_mask.gif").save(masks / f"{path.stem}_mask.gif")
    checkpoint = save_checkpoint(tmp_path / "m.pth", make_model(2), [0, 1])
    with caplog.at_level(logging.WARNING):
        assert run_predict("-m", checkpoint, "-i", imgs, "--output-dir", tmp_path / "out") == 0
        argv = ["-m", str(checkpoint), "--imgs", str(imgs), "--masks", str(masks), "--workers", "0", "--no-progress"]
        assert evaluate_cli.main(argv) == 0
    converted = [r.getMessage() for r in caplog.records if "convert" in r.getMessage()]
    assert len(converted) == 2, converted
    assert converted[0] == "2 grey image(s) were converted to RGB for the 3-channel model"
    assert converted[1].startswith("2 of 4 images") and "grey" in converted[1]
    assert len(list((tmp_path / "out").glob("*_OUT.png"))) == 4


def test_grey_photo_matches_its_rgb_copy_prediction(tmp_path):
    # Converted the way the dataset converts: a grey photo predicts as the RGB photo with three equal channels.
    model = make_model(2)
    checkpoint = save_checkpoint(tmp_path / "m.pth", model, [0, 1])
    grey = np.random.default_rng(0).integers(0, 256, (32, 48), dtype=np.uint8)
    Image.fromarray(grey).save(tmp_path / "grey.png")
    Image.fromarray(np.stack([grey] * 3, axis=-1)).save(tmp_path / "rgb.png")
    assert run_predict("-m", checkpoint, "-i", tmp_path / "grey.png", tmp_path / "rgb.png", "-s", "1") == 0
    np.testing.assert_array_equal(
        np.asarray(Image.open(tmp_path / "grey_OUT.png")), np.asarray(Image.open(tmp_path / "rgb_OUT.png"))
    )
