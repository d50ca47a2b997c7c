"""Tests for utils.datasets.synthetic: Carvana's layout, determinism, multiclass masks, refusing to overwrite data."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from utils.cli import parse_size
from utils.datasets.dataset import BasicDataset, CarvanaDataset
from utils.datasets.synthetic import generate_carvana_like, main
from utils.errors import USER_ERROR_EXIT_CODE, ConfigError, DatasetError

SIZE = (48, 32)
CARVANA_ID = re.compile(r"^[0-9a-f]{12}_(0[1-9]|1[0-6])$")


def files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.is_file()}


def test_carvana_layout_and_palette_gif_masks(tmp_path: Path) -> None:
    ids = generate_carvana_like(tmp_path, 18, size=SIZE, seed=0)

    assert len(ids) == len(set(ids)) == 18 and all(CARVANA_ID.match(name) for name in ids)
    assert ids[0].endswith("_01") and ids[15].endswith("_16") and ids[16].endswith("_01")
    assert ids[0][:12] == ids[15][:12] != ids[16][:12]  # 16 views per car, then a new car id
    assert sorted(files(tmp_path / "imgs")) == sorted(f"{name}.jpg" for name in ids)
    assert sorted(files(tmp_path / "masks")) == sorted(f"{name}_mask.gif" for name in ids)
    for name in ids:
        mask = Image.open(tmp_path / "masks" / f"{name}_mask.gif")
        image = Image.open(tmp_path / "imgs" / f"{name}.jpg")
        assert mask.mode == "P" and mask.size == image.size == SIZE and image.mode == "RGB"
        indices = np.asarray(mask)
        assert set(np.unique(indices).tolist()) == {0, 1}
        assert 0.03 < indices.mean() < 0.6  # a car, neither a speck nor the whole frame

    dataset = CarvanaDataset(tmp_path / "imgs", tmp_path / "masks", cache_dir=tmp_path / "cache", n_classes=1)
    assert dataset.mask_values == [0, 1] and len(dataset) == 18


def test_same_arguments_give_byte_identical_files(tmp_path: Path) -> None:
    first = generate_carvana_like(tmp_path / "a", 5, size=SIZE, seed=4)
    second = generate_carvana_like(tmp_path / "b", 5, size=SIZE, seed=4)
    shorter = generate_carvana_like(tmp_path / "c", 3, size=SIZE, seed=4)
    other = generate_carvana_like(tmp_path / "d", 5, size=SIZE, seed=5)

    assert first == second and shorter == first[:3]
    for folder in ("imgs", "masks"):
        assert files(tmp_path / "a" / folder) == files(tmp_path / "b" / folder)
        assert set(files(tmp_path / "c" / folder).items()) < set(files(tmp_path / "a" / folder).items())
    assert other != first


def test_multiclass_masks(tmp_path: Path) -> None:
    ids = generate_carvana_like(tmp_path / "five", 8, size=(64, 48), n_classes=5, seed=0)
    masks = [np.asarray(Image.open(tmp_path / "five" / "masks" / f"{name}.png")) for name in ids]
    assert all(mask.dtype == np.uint8 and mask.shape == (48, 64) for mask in masks)
    assert set(np.unique(np.stack(masks)).tolist()) == {0, 1, 2, 3, 4}
    dataset = BasicDataset(
        tmp_path / "five" / "imgs", tmp_path / "five" / "masks", cache_dir=tmp_path / "cache", n_classes=5
    )
    assert dataset.mask_values == [0, 1, 2, 3, 4]

    generate_carvana_like(tmp_path / "three", 4, size=(64, 48), n_classes=3, seed=0)
    values = {
        int(v) for path in (tmp_path / "three" / "masks").iterdir() for v in np.unique(np.asarray(Image.open(path)))
    }
    assert values == {0, 1, 2}  # with three classes the windows belong to the body
    with pytest.raises(ConfigError, match=r"--classes must be between 3 and 255, got 2"):
        generate_carvana_like(tmp_path / "two", 4, size=SIZE, n_classes=2)


def test_existing_data_is_kept_unless_forced(tmp_path: Path) -> None:
    old = generate_carvana_like(tmp_path, 3, size=SIZE, seed=0)
    (tmp_path / "imgs" / "keep").mkdir()
    (tmp_path / "imgs" / "README.txt").write_text("user notes")
    with pytest.raises(DatasetError, match=r"imgs already holds 5 entries; pass --force"):
        generate_carvana_like(tmp_path, 3, size=SIZE, seed=1)
    assert files(tmp_path / "masks").keys() == {f"{name}_mask.gif" for name in old}

    new = generate_carvana_like(tmp_path, 2, size=SIZE, seed=1, force=True)
    assert set(files(tmp_path / "imgs")) == {f"{name}.jpg" for name in new} | {"README.txt"}
    assert set(files(tmp_path / "masks")) == {f"{name}_mask.gif" for name in new}
    assert (tmp_path / "imgs" / "keep").is_dir()


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "out"), "--n", "2", "--size", "48x32", "--seed", "3"]) == 0
    assert len(files(tmp_path / "out" / "imgs")) == 2 and len(files(tmp_path / "out" / "masks")) == 2

    assert main([str(tmp_path / "bad"), "--size", "48by32"]) == USER_ERROR_EXIT_CODE
    assert "--size must look like WIDTHxHEIGHT" in capsys.readouterr().err
    assert main([str(tmp_path / "out"), "--n", "2", "--size", "48x32"]) == USER_ERROR_EXIT_CODE
    assert "pass --force" in capsys.readouterr().err
    assert parse_size("1918x1280", "--size") == (1918, 1280)
