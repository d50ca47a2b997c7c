"""Tests for utils.datasets.augmentation: joint transforms, reproducible per (seed, epoch, index) in any process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, Subset

from utils.datasets.augmentation import AugmentationConfig, JointAugmentation, sample_seed
from utils.datasets.dataset import CarvanaDataset
from utils.datasets.synthetic import generate_carvana_like

N_IMAGES = 12
NO_COLOUR = {"brightness": 0.0, "contrast": 0.0, "saturation": 0.0}


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("carvana")
    generate_carvana_like(root, N_IMAGES, size=(48, 32), seed=0)
    return root


def dataset(root: Path, **kwargs) -> CarvanaDataset:
    return CarvanaDataset(root / "imgs", root / "masks", cache_dir=root / "cache", **kwargs)


def all_items(loader: DataLoader) -> tuple[torch.Tensor, torch.Tensor]:
    batches = list(loader)
    return torch.cat([b["image"] for b in batches]), torch.cat([b["mask"] for b in batches])


def test_sample_seed_depends_on_seed_epoch_and_index() -> None:
    base = sample_seed(0, 1, 2)
    assert base == sample_seed(0, 1, 2)
    assert len({base, sample_seed(1, 1, 2), sample_seed(0, 2, 2), sample_seed(0, 1, 3), sample_seed(0, 12, 1)}) == 5
    assert 0 <= base < 2**63


def test_augmentation_is_off_by_default(data_root: Path) -> None:
    plain = dataset(data_root)
    for index in (0, 5):
        name = plain.ids[index]
        image = CarvanaDataset.preprocess(plain.mask_values, Image.open(data_root / "imgs" / f"{name}.jpg"), 1.0, False)
        mask = CarvanaDataset.preprocess(
            plain.mask_values, Image.open(data_root / "masks" / f"{name}_mask.gif"), 1.0, True
        )
        item = plain[index]
        assert np.array_equal(item["image"].numpy(), image) and np.array_equal(item["mask"].numpy(), mask)


def test_augmented_items_keep_shape_dtype_range_and_classes(data_root: Path) -> None:
    plain, augmented = dataset(data_root), dataset(data_root).with_augmentation(0)
    changed = 0
    for index in range(N_IMAGES):
        item, reference = augmented[index], plain[index]
        assert item["image"].shape == (3, 32, 48) and item["image"].dtype == torch.float32
        assert 0.0 <= item["image"].min() and item["image"].max() <= 1.0
        assert item["mask"].shape == (32, 48) and item["mask"].dtype == torch.int64
        assert set(item["mask"].unique().tolist()) <= {0, 1}
        changed += not torch.equal(item["image"], reference["image"])
    assert changed >= N_IMAGES - 1  # colour jitter alone changes practically every image


def test_same_seed_epoch_index_gives_the_same_sample(data_root: Path) -> None:
    first = dataset(data_root).with_augmentation(7)
    second = dataset(data_root).with_augmentation(7)
    other_seed = dataset(data_root).with_augmentation(8)
    a, b = first[3], second[3]
    assert torch.equal(a["image"], b["image"]) and torch.equal(a["mask"], b["mask"])
    assert not torch.equal(a["image"], other_seed[3]["image"])

    first.set_epoch(1)
    assert not torch.equal(first[3]["image"], a["image"])
    first.set_epoch(0)
    assert torch.equal(first[3]["image"], a["image"])


def test_samples_do_not_depend_on_workers_order_or_subset(data_root: Path) -> None:
    augmented = dataset(data_root).with_augmentation(3)
    augmented.set_epoch(2)
    images, masks = all_items(DataLoader(augmented, batch_size=4, num_workers=0))
    images_2w, masks_2w = all_items(DataLoader(augmented, batch_size=4, num_workers=2))
    assert torch.equal(images, images_2w) and torch.equal(masks, masks_2w)

    reversed_order = list(range(N_IMAGES))[::-1]
    images_rev, masks_rev = all_items(DataLoader(augmented, batch_size=5, sampler=reversed_order))
    assert torch.equal(images_rev, images.flip(0)) and torch.equal(masks_rev, masks.flip(0))

    subset = Subset(augmented, [9, 2])
    assert torch.equal(subset[0]["image"], images[9]) and torch.equal(subset[1]["mask"], masks[2])


def test_augmentation_leaves_the_callers_random_state_alone(data_root: Path) -> None:
    augmented = dataset(data_root).with_augmentation(0)
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    augmented[0]
    assert torch.equal(torch.get_rng_state(), state)


def test_flip_moves_image_and_mask_together() -> None:
    config = AugmentationConfig(hflip_probability=1.0, crop_scale=(1.0, 1.0), **NO_COLOUR)
    image = torch.rand(3, 8, 12)
    mask = torch.randint(0, 3, (8, 12))
    out_image, out_mask = JointAugmentation(seed=0, config=config)(image, mask, epoch=0, index=0)
    assert torch.equal(out_image, image.flip(-1)) and torch.equal(out_mask, mask.flip(-1))
    assert type(out_image) is torch.Tensor and type(out_mask) is torch.Tensor


def test_crop_moves_image_and_mask_together_and_mask_stays_nearest() -> None:
    augmentation = JointAugmentation(seed=0, config=AugmentationConfig(crop_scale=(0.3, 0.6), **NO_COLOUR))
    yy, xx = torch.meshgrid(torch.arange(64), torch.arange(96), indexing="ij")
    mask = (((yy // 8) + (xx // 8)) % 2).long() * 2  # a checkerboard of classes 0 and 2
    image = (mask.float() / 2).expand(3, -1, -1).clone()
    for index in range(5):
        out_image, out_mask = augmentation(image, mask, epoch=0, index=index)
        assert set(out_mask.unique().tolist()) <= {0, 2}  # nearest neighbours: no in-between class
        agreement = ((out_image[0] > 0.5) == (out_mask == 2)).float().mean()
        assert agreement > 0.9  # only pixels on square edges may disagree (bilinear image vs nearest mask)
