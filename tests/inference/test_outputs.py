"""Class indices back to the dataset's mask values (milesial's mask_to_image semantics)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from utils.checkpoint.format import InferenceRecord
from utils.checkpoint.model import ModelSpec, check_mask_values_of
from utils.errors import CheckpointError
from utils.inference.engine import mask_values_to_write
from utils.inference.writer import mask_to_image

CLASSES = np.array([[0, 1, 1], [1, 0, 0]], dtype=np.uint8)
THREE_CLASSES = np.array([[0, 1, 2], [2, 1, 0]], dtype=np.uint8)


def test_carvana_values_become_a_one_bit_png_that_round_trips(tmp_path):
    image = mask_to_image(CLASSES, [0, 1])
    assert image.mode == "1"
    image.save(tmp_path / "m.png")
    reopened = Image.open(tmp_path / "m.png")
    assert reopened.mode == "1"
    np.testing.assert_array_equal(np.asarray(reopened), CLASSES.astype(bool))


def test_zero_255_values_become_an_8_bit_grey_image():
    image = mask_to_image(CLASSES, [0, 255])
    assert image.mode == "L"
    np.testing.assert_array_equal(np.asarray(image), CLASSES * 255)


def test_multiclass_grey_values_keep_their_original_values():
    image = mask_to_image(THREE_CLASSES, [0, 100, 200])
    assert image.mode == "L"
    np.testing.assert_array_equal(np.asarray(image), [[0, 100, 200], [200, 100, 0]])


def test_values_above_255_become_16_bit(tmp_path):
    image = mask_to_image(CLASSES, [0, 1000])
    assert image.mode == "I;16"
    image.save(tmp_path / "m.png")
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "m.png")), CLASSES.astype(np.int64) * 1000)


def test_colour_values_become_an_rgb_image_with_each_class_colour():
    colours = [[0, 0, 0], [255, 0, 0], [0, 128, 255]]
    image = mask_to_image(THREE_CLASSES, colours)
    assert image.mode == "RGB"
    pixels = np.asarray(image)
    assert pixels[0, 0].tolist() == colours[0]
    assert pixels[0, 1].tolist() == colours[1]
    assert pixels[0, 2].tolist() == colours[2]
    assert pixels[1, 0].tolist() == colours[2]


def _spec(n_classes: int, mask_values: list | None, ignore_values: tuple[int, ...] = ()) -> ModelSpec:
    return ModelSpec(
        n_classes=n_classes, mask_values=mask_values, inference=InferenceRecord(ignore_values=ignore_values)
    )


def test_mask_values_are_checked_where_the_checkpoint_is_read_and_what_a_mask_cannot_hold_before_writing():
    # predict.py writes what the reader let through: one value per class, grey values and colours not mixed.
    with pytest.raises(CheckpointError, match="name 2 values but the model predicts 3"):
        check_mask_values_of([0, 1], 3, "m.pth")
    with pytest.raises(CheckpointError, match="mix grey values and colours"):
        check_mask_values_of([0, [1, 2, 3]], 2, "m.pth")
    assert mask_values_to_write(_spec(2, [0, 65535]), Path("m.pth")) == [0, 65535]
    with pytest.raises(CheckpointError, match="does not fit a 16-bit PNG mask"):
        mask_values_to_write(_spec(2, [0, 65536]), Path("m.pth"))
    # A class written as a void value would read back as "not labelled".
    assert mask_values_to_write(_spec(2, [0, 255], ignore_values=(128,)), Path("m.pth")) == [0, 255]
    with pytest.raises(
        CheckpointError, match=r"m.pth maps classes to mask value\(s\) \[255\] that it was trained to ignore"
    ):
        mask_values_to_write(_spec(2, [0, 255], ignore_values=(255,)), Path("m.pth"))


def test_default_values_follow_milesial_for_binary_models(caplog):
    assert mask_values_to_write(_spec(1, None), Path("m.pth")) == [0, 1]
    assert "m.pth stores no mask_values; writing classes as [0, 1]" in caplog.text
    assert mask_values_to_write(_spec(2, None), Path("m.pth")) == [0, 1]
    assert mask_values_to_write(_spec(4, None), Path("m.pth")) == [0, 1, 2, 3]
