"""Photos with an EXIF orientation are used upright, masks alike; caches notice a change whose mtime was put back."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from utils.datasets.dataset import BasicDataset
from utils.datasets.image_files import EXIF_ORIENTATION_TAG, image_header, load_image

# Stored (raw) size; an orientation of 6 shows it turned by 90 degrees: HEIGHT wide and WIDTH high.
WIDTH, HEIGHT = 48, 32
ROTATE_90 = 6


def stored_pixels() -> np.ndarray:
    """Left half dark, right half bright: any turn of the picture moves the bright part somewhere else."""
    pixels = np.full((HEIGHT, WIDTH, 3), 30, dtype=np.uint8)
    pixels[:, WIDTH // 2 :] = 220
    return pixels


def save_with_orientation(image: Image.Image, path: Path, orientation: int | None) -> Path:
    exif = Image.Exif()
    if orientation is not None:
        exif[EXIF_ORIENTATION_TAG] = orientation
    image.save(path, exif=exif)
    return path


def test_a_jpeg_with_an_exif_rotation_loads_upright_with_its_upright_size(tmp_path):
    path = save_with_orientation(Image.fromarray(stored_pixels()), tmp_path / "phone.jpg", ROTATE_90)
    with Image.open(path) as raw:
        assert raw.size == (WIDTH, HEIGHT) and raw.getexif()[EXIF_ORIENTATION_TAG] == ROTATE_90
        upright = np.asarray(ImageOps.exif_transpose(raw))
    with load_image(path) as loaded:
        assert np.array_equal(np.asarray(loaded), upright)
    assert upright.shape[:2] == (WIDTH, HEIGHT)
    assert image_header(path)[:2] == (HEIGHT, WIDTH)


@pytest.mark.parametrize("mask_drawn", ["upright", "tagged_like_its_photo"])
def test_photo_and_mask_are_turned_alike(tmp_path, mask_drawn):
    """A mask drawn on the upright photo (labelling tools show photos upright), or one carrying the same EXIF tag as
    its photo, lines up with the photo: the bright half of the photo is the foreground of the mask."""
    imgs, masks = tmp_path / "imgs", tmp_path / "masks"
    imgs.mkdir()
    masks.mkdir()
    save_with_orientation(Image.fromarray(stored_pixels()), imgs / "a.jpg", ROTATE_90)
    stored_mask = Image.fromarray(((stored_pixels()[..., 0] > 128) * 255).astype(np.uint8))
    if mask_drawn == "upright":
        ImageOps.exif_transpose(Image.open(imgs / "a.jpg")).convert("L").point(lambda v: 255 * (v > 128)).save(
            masks / "a.png"
        )
    else:
        save_with_orientation(stored_mask, masks / "a.png", ROTATE_90)
    item = BasicDataset(imgs, masks, 1.0, cache_dir=tmp_path / "values")[0]
    assert item["image"].shape[1:] == item["mask"].shape == (WIDTH, HEIGHT)
    bright = item["image"][0] > 0.5
    assert bright.any() and not bright.all()
    assert torch.equal(bright, item["mask"] == 1)


def test_the_pixel_cache_notices_a_change_whose_mtime_was_put_back(tmp_path):
    imgs, masks = tmp_path / "imgs", tmp_path / "masks"
    imgs.mkdir()
    masks.mkdir()
    Image.fromarray(stored_pixels()).save(imgs / "a.png")
    Image.fromarray(np.zeros((HEIGHT, WIDTH), dtype=np.uint8)).save(masks / "a.png")

    def first_image() -> torch.Tensor:
        data = BasicDataset(imgs, masks, 1.0, cache_dir=tmp_path / "values", pixel_cache_dir=tmp_path / "pixels")
        return data[0]["image"]

    assert first_image().max() > 0.5
    stat = (imgs / "a.png").stat()
    flipped = stored_pixels()[:, ::-1].copy()  # the same size on disk, other pixels
    Image.fromarray(flipped).save(imgs / "a.png")
    os.utime(imgs / "a.png", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (imgs / "a.png").stat().st_mtime_ns == stat.st_mtime_ns
    assert (imgs / "a.png").stat().st_size == stat.st_size
    assert torch.equal(first_image(), torch.from_numpy(flipped).permute(2, 0, 1).float() / 255)
