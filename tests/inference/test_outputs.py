"""Class indices back to the dataset's mask values (milesial's mask_to_image semantics)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from utils.checkpoint.model import check_mask_values_of
from utils.errors import CheckpointError
from utils.inference.writer import check_mask_values, default_mask_values, mask_to_image

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


def test_mask_values_are_checked_where_the_checkpoint_is_read_and_wide_grey_values_before_writing():
    # predict.py writes what the reader let through: one value per class, grey values and colours not mixed.
    with pytest.raises(CheckpointError, match="name 2 values but the model predicts 3"):
        check_mask_values_of([0, 1], 3, "m.pth")
    with pytest.raises(CheckpointError, match="mix grey values and colours"):
        check_mask_values_of([0, [1, 2, 3]], 2, "m.pth")
    check_mask_values([0, 65535])
    with pytest.raises(CheckpointError, match="does not fit a 16-bit PNG mask"):
        check_mask_values([0, 65536])


def test_default_values_follow_milesial_for_binary_models():
    assert default_mask_values(1) == [0, 1]
    assert default_mask_values(2) == [0, 1]
    assert default_mask_values(4) == [0, 1, 2, 3]
