"""predict.py's outputs stay out of the way: a dataset scan skips *_OUT / *_VIZ files with one warning."""

from __future__ import annotations

import json
import logging
import shutil

import evaluate as evaluate_cli
import predict
from utils.datasets.dataset import BasicDataset
from utils.datasets.image_files import OUTPUT_SUFFIX, VIZ_SUFFIX, index_folder
from utils.inference import writer


def test_the_suffixes_have_one_home():
    assert writer.OUTPUT_SUFFIX is OUTPUT_SUFFIX and writer.VIZ_SUFFIX is VIZ_SUFFIX


def test_evaluating_a_folder_after_predicting_into_it_works_with_one_warning(
    tmp_path, carvana_data, binary_checkpoint, caplog
):
    imgs = tmp_path / "imgs"
    shutil.copytree(carvana_data.imgs, imgs)
    argv = ["-m", str(binary_checkpoint), "-i", str(imgs), "--viz", "--workers", "0", "--no-progress"]
    assert predict.main(argv) == 0
    assert len(list(imgs.glob(f"*{OUTPUT_SUFFIX}.png"))) == len(list(imgs.glob(f"*{VIZ_SUFFIX}.png"))) == 16
    report = tmp_path / "scores.json"
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        argv = ["-m", str(binary_checkpoint), "--imgs", str(imgs), "--masks", str(carvana_data.masks)]
        assert evaluate_cli.main([*argv, "--json", str(report), "--workers", "0", "--no-progress"]) == 0
    assert json.loads(report.read_text())["n_images"] == 16
    warnings = [r.getMessage() for r in caplog.records if "predict.py's outputs" in r.getMessage()]
    assert len(warnings) == 1 and "32 file(s)" in warnings[0] and str(imgs) in warnings[0]


def test_dataset_and_index_skip_prediction_files(tmp_path, carvana_data):
    imgs = tmp_path / "imgs"
    shutil.copytree(carvana_data.imgs, imgs)
    first = sorted(imgs.iterdir())[0]
    shutil.copy(first, imgs / f"{first.stem}{OUTPUT_SUFFIX}.png")
    assert f"{first.stem}{OUTPUT_SUFFIX}" not in index_folder(imgs, "image")
    assert len(BasicDataset(imgs, carvana_data.masks, 0.5, "_mask")) == 16
