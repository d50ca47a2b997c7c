"""A -t that a two-class model ignores is said; evaluate's errors do not speak of training."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from PIL import Image

import evaluate as evaluate_cli
import predict
from tests.helpers import make_model, one_error_line, save_checkpoint, write_images
from utils.errors import USER_ERROR_EXIT_CODE


@pytest.mark.parametrize(("n_classes", "threshold", "warned"), [(2, "0.3", True), (2, "0.5", False), (1, "0.3", False)])
def test_a_mask_threshold_a_model_ignores_is_warned_about(tmp_path, caplog, n_classes, threshold, warned):
    checkpoint = save_checkpoint(tmp_path / "model.pth", make_model(n_classes), [0, 1])
    [image] = write_images(tmp_path / "in", [(48, 32)])
    with caplog.at_level(logging.WARNING):
        code = predict.main(
            ["-m", str(checkpoint), "-i", str(image), "-t", threshold, "--workers", "0", "--no-progress"]
        )
    assert code == 0
    assert ("--mask-threshold 0.3 is ignored" in caplog.text) is warned, caplog.text


def test_evaluate_on_masks_with_too_many_values_does_not_speak_of_training(tmp_path, capsys):
    checkpoint = save_checkpoint(tmp_path / "model.pth", make_model(2), [0, 1])
    images = write_images(tmp_path / "imgs", [(48, 32), (48, 32)])
    (tmp_path / "masks").mkdir()
    for index, image in enumerate(images):
        Image.fromarray(np.full((32, 48), index * 2, dtype=np.uint8) + np.eye(32, 48, dtype=np.uint8)).save(
            tmp_path / "masks" / image.name
        )
    argv = ["-m", str(checkpoint), "--imgs", str(tmp_path / "imgs"), "--masks", str(tmp_path / "masks")]
    assert evaluate_cli.main([*argv, "--workers", "0", "--no-progress"]) == USER_ERROR_EXIT_CODE
    line = one_error_line(capsys.readouterr().err)
    assert "distinct values" in line and "train" not in line.replace(str(tmp_path), ""), line
