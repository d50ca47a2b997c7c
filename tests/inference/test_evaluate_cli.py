"""evaluate.py: per-class Dice/IoU table and JSON, mask naming detection, mask values checked against the model."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

import evaluate as evaluate_cli
import utils.evaluation
from tests.helpers import make_model, one_error_line, save_checkpoint, write_images
from utils.datasets.dataset import CarvanaDataset
from utils.errors import USER_ERROR_EXIT_CODE


def run_evaluate(*args: str, workers: int = 0) -> int:
    """evaluate.main in this process, without progress bar and (unless asked) without worker processes."""
    return evaluate_cli.main([*args, "--no-progress", "--workers", str(workers)])


def test_evaluate_is_reexported_like_milesial():
    from evaluate import evaluate

    assert evaluate is utils.evaluation.evaluate


def test_a_model_scored_on_its_own_predictions_is_perfect(self_labelled_masks, carvana_data, tmp_path, capsys):
    checkpoint = save_checkpoint(tmp_path / "m.pth", make_model(2), [0, 255])
    images, masks = carvana_data.imgs, self_labelled_masks(checkpoint)
    report = tmp_path / "scores.json"
    assert run_evaluate("-m", str(checkpoint), "--imgs", str(images), "--masks", str(masks), "-s", "1",
                        "-b", "4", "--json", str(report)) == 0  # fmt: skip
    scores = json.loads(report.read_text())
    assert scores["n_images"] == 16 and scores["mask_values"] == [0, 255]
    assert scores["per_class_dice"] == [1.0, 1.0] and scores["per_class_iou"] == [1.0, 1.0]
    table = capsys.readouterr().out
    assert "Dice" in table and "IoU" in table and "mean (classes 1+)" in table
    assert re.search(r"^1 +255 +1\.0000 +1\.0000$", table, re.MULTILINE)


# With worker processes the dataset, its aligned mask values and the collate function run in other processes.
@pytest.mark.parametrize("workers", [0, 2])
def test_scores_are_those_of_the_evaluation_module_on_carvana_naming(carvana_data, tmp_path, workers):
    model = make_model(2)
    checkpoint = save_checkpoint(tmp_path / "m.pth", model, [0, 1], style="milesial")
    report = tmp_path / "scores.json"
    assert run_evaluate("-m", str(checkpoint), "--imgs", str(carvana_data.imgs), "--masks", str(carvana_data.masks),
                        "-s", "0.5", "-b", "4", "--json", str(report), workers=workers) == 0  # fmt: skip
    scores = json.loads(report.read_text())
    loader = DataLoader(CarvanaDataset(carvana_data.imgs, carvana_data.masks, 0.5), batch_size=4)
    expected = utils.evaluation.evaluate_segmentation(model, loader, torch.device("cpu"), n_classes=2, progress=False)
    assert scores["per_class_dice"] == pytest.approx(expected.per_class_dice, abs=1e-6)
    assert scores["per_class_iou"] == pytest.approx(expected.per_class_iou, abs=1e-6)
    assert scores["dice"] == pytest.approx(expected.dice, abs=1e-6)
    # An untrained model is not perfect: the numbers are real scores, not a constant.
    assert scores["dice"] < 0.99


def test_masks_with_values_the_model_never_saw_are_one_clear_error(carvana_data, tmp_path, capsys):
    checkpoint = save_checkpoint(tmp_path / "m.pth", make_model(2), [0, 255])
    code = run_evaluate("-m", str(checkpoint), "--imgs", str(carvana_data.imgs), "--masks", str(carvana_data.masks))
    assert code == USER_ERROR_EXIT_CODE
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    line = one_error_line(err)
    assert "hold values [0, 1]" in line and "was trained on [0, 255]" in line


def test_masks_using_some_of_the_models_classes_are_scored_with_its_class_numbers(carvana_data, tmp_path, capsys):
    # Trained on three values, validated on masks that only hold the first two: class k still means value k.
    checkpoint = save_checkpoint(tmp_path / "m.pth", make_model(3), [0, 1, 2])
    report = tmp_path / "scores.json"
    assert run_evaluate("-m", str(checkpoint), "--imgs", str(carvana_data.imgs), "--masks", str(carvana_data.masks),
                        "--json", str(report)) == 0  # fmt: skip
    scores = json.loads(report.read_text())
    assert scores["mask_values"] == [0, 1, 2] and len(scores["per_class_dice"]) == 3


def test_a_missing_mask_folder_is_one_clear_error(carvana_data, tmp_path, capsys):
    checkpoint = save_checkpoint(tmp_path / "m.pth", make_model(2), [0, 1])
    code = run_evaluate("-m", str(checkpoint), "--imgs", str(carvana_data.imgs), "--masks", str(tmp_path / "none"))
    assert code == USER_ERROR_EXIT_CODE
    assert "does not exist" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("workers", [0, 2])
def test_images_of_mixed_sizes_are_batched_by_size_with_the_scores_of_batch_size_one(tmp_path, workers):
    images = write_images(tmp_path / "imgs", [(48, 32), (64, 48), (48, 32), (56, 40), (64, 48)])
    masks = tmp_path / "masks"
    masks.mkdir()
    for path in images:
        width, height = Image.open(path).size
        Image.fromarray((np.arange(width)[None, :].repeat(height, 0) % 2).astype(np.uint8)).save(masks / path.name)
    checkpoint = save_checkpoint(tmp_path / "m.pth", make_model(2), [0, 1])
    scores = {}
    for batch_size in (1, 2, 4):
        report = tmp_path / f"b{batch_size}.json"
        code = run_evaluate("-m", str(checkpoint), "--imgs", str(tmp_path / "imgs"), "--masks", str(masks), "-s", "1",
                            "-b", str(batch_size), "--json", str(report), workers=workers)  # fmt: skip
        assert code == 0
        scores[batch_size] = json.loads(report.read_text())
    assert scores[1]["n_images"] == scores[4]["n_images"] == 5
    for batch_size in (2, 4):
        assert scores[batch_size]["per_class_dice"] == pytest.approx(scores[1]["per_class_dice"], abs=1e-6)


def test_each_folder_is_listed_once(carvana_data, tmp_path, monkeypatch):
    """The Carvana naming is detected from the dataset's own folder index, not from a second listing."""
    from utils.datasets import image_files

    listed = []
    real_index = image_files.index_folder

    def counting_index(folder, role):
        listed.append(role)
        return real_index(folder, role)

    monkeypatch.setattr(image_files, "index_folder", counting_index)  # where the dataset's pairing indexes
    checkpoint = save_checkpoint(tmp_path / "m.pth", make_model(2), [0, 1])
    assert run_evaluate("-m", str(checkpoint), "--imgs", str(carvana_data.imgs), "--masks", str(carvana_data.masks),
                        "-s", "0.5") == 0  # fmt: skip
    assert listed == ["image", "mask"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-m", "m.pth"], "the following arguments are required: --imgs, --masks (see python evaluate.py --help)"),
        (["--imgs", "i", "--masks", "m", "--jsno", "s.json"], "--jsno s.json; did you mean --json?"),
        (["--imgs", "i", "--masks", "m", "--scale", "2"], "--scale must be a finite number in (0, 1], got 2"),
        (["--imgs", "i", "--masks", "m", "-b", "0"], "--batch-size must be at least 1"),
    ],
)
def test_bad_flags_are_one_line_as_train_py_words_them(capsys, argv, message):
    assert evaluate_cli.main(argv) == USER_ERROR_EXIT_CODE
    assert message in one_error_line(capsys.readouterr().err)


def test_images_that_cannot_feed_the_models_channels_are_one_error_line(carvana_data, tmp_path, capsys):
    # A 4-channel model: the dataset converts photos for 1- and 3-channel models only, so RGB photos are refused.
    from unet import UNet

    checkpoint = save_checkpoint(tmp_path / "m.pth", UNet(4, 2, base_channels=8), [0, 1])
    code = run_evaluate("-m", str(checkpoint), "--imgs", str(carvana_data.imgs), "--masks", str(carvana_data.masks))
    assert code == USER_ERROR_EXIT_CODE
    line = one_error_line(capsys.readouterr().err)
    assert f"--model {checkpoint} expects 4-channel images but the images in --imgs {carvana_data.imgs} have 3" in line
