"""Void mask values (--ignore-value) and the per-class pixel counts of the mask scan."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import paint_void_borders
from utils.datasets.dataset import BasicDataset
from utils.datasets.mask_values import CACHE_FORMAT_VERSION, IGNORE_INDEX, value_counts, values_to_classes
from utils.errors import DatasetError


@pytest.fixture(scope="module")
def void_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    from utils.datasets.synthetic import generate_carvana_like

    root = tmp_path_factory.mktemp("void")
    generate_carvana_like(root, 6, size=(48, 32), n_classes=3, seed=1)
    return root, paint_void_borders(root / "masks", width=2)


def test_values_to_classes_maps_void_values_to_the_ignore_index() -> None:
    mask = np.array([[0, 1, 255], [2, 255, 0]], dtype=np.uint8)
    classes = values_to_classes(mask, [0, 1, 2], ignore_values=[255])
    assert classes.tolist() == [[0, 1, IGNORE_INDEX], [2, IGNORE_INDEX, 0]]
    # The same through the searchsorted path of wider masks.
    assert values_to_classes(mask.astype(np.int32), [0, 1, 2], ignore_values=[255]).tolist() == classes.tolist()
    with pytest.raises(DatasetError, match=r"mask value\(s\) \[255\]"):
        values_to_classes(mask, [0, 1, 2])


def test_value_counts_of_every_mask_kind() -> None:
    grey = np.array([[0, 0, 7], [7, 7, 255]], dtype=np.uint8)
    assert value_counts(grey) == ([0, 7, 255], [2, 3, 1])
    assert value_counts(grey.astype(np.int32)) == ([0, 7, 255], [2, 3, 1])
    colour = np.zeros((1, 3, 3), dtype=np.uint8)
    colour[0, 2] = [9, 8, 7]
    assert value_counts(colour) == ([0, 0x090807], [2, 1])  # colours packed as 0xRRGGBB


def test_void_values_are_not_classes_and_are_counted(
    void_data: tuple[Path, int], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, painted = void_data
    plain = BasicDataset(root / "imgs", root / "masks", 1.0, None, cache_dir=tmp_path)
    assert plain.mask_values == [0, 1, 2, 255]  # without the flag 255 is a fourth value
    with caplog.at_level("INFO", logger="utils.datasets.dataset"):
        dataset = BasicDataset(
            root / "imgs", root / "masks", 1.0, None, n_classes=3, ignore_values=[255], cache_dir=tmp_path
        )
    assert f"{painted} of {6 * 48 * 32} mask pixels" in caplog.text
    assert dataset.mask_values == [0, 1, 2]
    assert dataset.void_pixels == painted
    counts = dataset.class_pixel_counts()
    assert len(counts) == 3 and sum(counts) + painted == 6 * 48 * 32
    assert dataset.class_pixel_counts([0]) == [
        int((dataset[0]["mask"] == k).sum()) for k in range(3)
    ]  # the scan's counts are the item's pixels (scale 1)
    mask = dataset[0]["mask"]
    assert torch.all(mask[:2] == IGNORE_INDEX) and torch.all(mask[:, -2:] == IGNORE_INDEX)
    assert set(mask[2:-2, 2:-2].unique().tolist()) <= {0, 1, 2}


def test_the_cache_stores_per_image_counts(void_data: tuple[Path, int], tmp_path: Path) -> None:
    root, _ = void_data
    first = BasicDataset(root / "imgs", root / "masks", 1.0, None, ignore_values=[255], cache_dir=tmp_path)
    (cache_file,) = tmp_path.glob("*.json")
    content = json.loads(cache_file.read_text())
    assert CACHE_FORMAT_VERSION == 6 and len(content["rows"]) == 6
    # Each pair's row ends with its mask's values (the void 255 among them) and their pixels, before scaling.
    assert all(row[-2][-1] == 255 and sum(row[-1]) == 48 * 32 for row in content["rows"])
    again = BasicDataset(root / "imgs", root / "masks", 1.0, None, ignore_values=[255], cache_dir=tmp_path)
    assert again.class_pixel_counts() == first.class_pixel_counts()
    assert [again.has_foreground(i) for i in range(6)] == [first.has_foreground(i) for i in range(6)]
    # Rows changed after the file was written (here: without their counts) are not read: the masks are scanned again.
    content["rows"] = [row[:-1] for row in content["rows"]]
    cache_file.write_text(json.dumps(content, separators=(",", ":")))
    rescanned = BasicDataset(root / "imgs", root / "masks", 1.0, None, ignore_values=[255], cache_dir=tmp_path)
    assert rescanned.class_pixel_counts() == first.class_pixel_counts()
