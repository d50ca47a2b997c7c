"""predict.py's --pixel-cache: the inputs come from training's pixel cache, identical to decoding them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.datasets.test_pixel_cache import HEIGHT, WIDTH, write_photos
from utils.datasets.dataset import IMAGE, BasicDataset
from utils.datasets.image_files import FileInfo
from utils.errors import ConfigError
from utils.inference.config import PredictConfig, parse_inference_config
from utils.inference.engine import PredictionInputs
from utils.inference.export import Preprocessing

# The training cache's configuration: half size, RGB.
HALF_RGB = Preprocessing(0.5, [0, 1], 3)


def entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.npy"))


def test_inputs_from_the_training_cache_equal_decoded_ones(tmp_path: Path) -> None:
    images_dir, masks_dir = write_photos(tmp_path / "data", grey=(1,))
    cache = tmp_path / "pixels"
    training = BasicDataset(images_dir, masks_dir, 0.5, None, cache_dir=tmp_path / "values", pixel_cache_dir=cache)
    for index in range(len(training)):
        training.fill_pixel_cache(index)
    filled = entries(cache)
    paths = sorted(images_dir.iterdir())
    decoded = PredictionInputs(paths, HALF_RGB, PredictConfig())
    cached = PredictionInputs(paths, HALF_RGB, PredictConfig(pixel_cache=cache))
    for index in range(len(paths)):
        plain, read = decoded[index], cached[index]
        assert read.error is None and torch.equal(read.image, plain.image)
        assert read.original_size == plain.original_size == (HEIGHT, WIDTH)
        assert read.converted == plain.converted
    assert cached[1].converted, "the grey photo is still reported as converted"
    assert entries(cache) == filled, "training's entries were found: nothing new was written"

    # The item really comes from the entry: a different array stored under its key is what predict sees.
    cached.pixel_cache.write(FileInfo.of(paths[0]), IMAGE, np.zeros((HEIGHT // 2, WIDTH // 2, 3), np.uint8))
    assert not cached[0].image.any()


def test_a_miss_is_decoded_and_stored_and_viz_decodes(tmp_path: Path) -> None:
    images_dir, _ = write_photos(tmp_path / "data")
    paths = sorted(images_dir.iterdir())
    cache = tmp_path / "pixels"
    first = PredictionInputs(paths, HALF_RGB, PredictConfig(pixel_cache=cache))
    items = [first[i] for i in range(len(paths))]
    assert len(entries(cache)) == len(paths)
    again = PredictionInputs(paths, HALF_RGB, PredictConfig(pixel_cache=cache))
    assert all(torch.equal(again[i].image, items[i].image) for i in range(len(paths)))
    assert PredictionInputs(paths, HALF_RGB, PredictConfig(viz=True, pixel_cache=cache)).pixel_cache is None
    broken = tmp_path / "other" / "broken.jpg"
    broken.parent.mkdir()
    broken.write_bytes(b"not an image")
    assert "cannot read image" in (
        PredictionInputs([broken], HALF_RGB, PredictConfig(pixel_cache=cache))[0].error or ""
    )


def test_the_flag_reaches_the_config_and_a_cache_inside_the_inputs_is_refused(tmp_path: Path) -> None:
    images_dir, _ = write_photos(tmp_path / "data")
    config = parse_inference_config(
        PredictConfig, "predict.py", ["-i", str(images_dir), "--pixel-cache", str(tmp_path / "p")], "a\n\nb"
    )
    assert config.pixel_cache == tmp_path / "p"
    assert parse_inference_config(PredictConfig, "predict.py", ["-i", str(images_dir)], "a\n\nb").pixel_cache is None
    with pytest.raises(ConfigError, match="inside the data folder"):
        PredictionInputs(sorted(images_dir.iterdir()), HALF_RGB, PredictConfig(pixel_cache=images_dir / "cache"))
