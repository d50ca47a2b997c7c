"""Tests for utils.datasets.dataset, utils.datasets.mask_values and utils.datasets.image_files on small real files."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from utils.datasets import image_files, mask_values
from utils.datasets.dataset import BasicDataset, CarvanaDataset
from utils.datasets.image_files import IMAGE_EXTENSIONS, detect_mask_suffix, load_image
from utils.errors import ConfigError, DatasetError

WIDTH, HEIGHT = 48, 32


def random_image(seed: int, size: tuple[int, int] = (WIDTH, HEIGHT), channels: int = 3) -> np.ndarray:
    shape = (size[1], size[0], channels) if channels > 1 else (size[1], size[0])
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def index_mask(seed: int, values: list[int], size: tuple[int, int] = (WIDTH, HEIGHT)) -> np.ndarray:
    """A uint8 (uint16 above 255) mask of horizontal bands: every value appears, and survives nearest resizing."""
    rng = np.random.default_rng(seed)
    dtype = np.uint8 if max(values) < 256 else np.uint16
    rows = rng.permutation(np.resize(np.asarray(values, dtype=dtype), size[1]))
    return np.repeat(rows[:, None], size[0], axis=1)


def save_palette_gif(path: Path, indices: np.ndarray) -> None:
    mask = Image.fromarray(indices)
    mask.putpalette([0, 0, 0, 255, 255, 255])
    mask.save(path)


def write_dataset(
    root: Path,
    masks: dict[str, np.ndarray],
    *,
    mask_suffix: str = "",
    mask_ext: str = ".png",
    image_ext: str = ".png",
) -> tuple[Path, Path]:
    """Write one random RGB image per mask (same size) and the masks as PNG/GIF/JPEG/NPY; return both folders."""
    images_dir, masks_dir = root / "imgs", root / "masks"
    images_dir.mkdir(parents=True, exist_ok=True)
    masks_dir.mkdir(parents=True, exist_ok=True)
    for seed, (name, mask) in enumerate(sorted(masks.items())):
        size = (mask.shape[1], mask.shape[0])
        Image.fromarray(random_image(seed, size)).save(images_dir / f"{name}{image_ext}")
        mask_path = masks_dir / f"{name}{mask_suffix}{mask_ext}"
        if mask_ext == ".gif":
            save_palette_gif(mask_path, mask)
        elif mask_ext == ".npy":
            np.save(mask_path, mask)
        else:
            Image.fromarray(mask).save(mask_path)
    return images_dir, masks_dir


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def build(images_dir: Path, masks_dir: Path, cache_dir: Path, **kwargs) -> BasicDataset:
    return BasicDataset(images_dir, masks_dir, cache_dir=cache_dir, **kwargs)


# ---------------------------------------------------------------- mask formats


def test_carvana_palette_gif_masks(tmp_path: Path, cache_dir: Path) -> None:
    masks = {f"car{i}_{v:02d}": index_mask(i * 16 + v, [0, 1]) for i in range(2) for v in (1, 2)}
    images_dir, masks_dir = write_dataset(tmp_path, masks, mask_suffix="_mask", mask_ext=".gif", image_ext=".jpg")
    dataset = CarvanaDataset(images_dir, masks_dir, cache_dir=cache_dir)

    assert dataset.mask_suffix == "_mask"
    assert dataset.mask_values == [0, 1]
    assert dataset.ids == sorted(masks)
    assert len(dataset) == 4
    item = dataset[2]
    assert item["image"].dtype == torch.float32 and item["image"].shape == (3, HEIGHT, WIDTH)
    assert 0.0 <= item["image"].min() and item["image"].max() <= 1.0
    assert item["mask"].dtype == torch.int64
    assert torch.equal(item["mask"], torch.from_numpy(masks[dataset.ids[2]].astype(np.int64)))


def test_grey_0_255_masks_become_classes_0_1(tmp_path: Path, cache_dir: Path) -> None:
    masks = {name: index_mask(seed, [0, 255]) for seed, name in enumerate(["a", "b"])}
    dataset = build(*write_dataset(tmp_path, masks), cache_dir)

    assert dataset.mask_values == [0, 255]
    assert torch.equal(dataset[1]["mask"], torch.from_numpy(masks["b"] // 255).long())


def test_one_bit_masks_read_as_0_1_like_predicted_carvana_masks(tmp_path: Path, cache_dir: Path) -> None:
    masks = {name: index_mask(seed, [0, 1]) for seed, name in enumerate(["a", "b"])}
    images_dir, masks_dir = write_dataset(tmp_path, masks)
    for name, mask in masks.items():
        # predict.py writes Carvana's 0/1 masks as 1-bit PNGs; reading them back must give the same values.
        Image.fromarray(mask.astype(bool)).convert("1").save(masks_dir / f"{name}.png")
    dataset = build(images_dir, masks_dir, cache_dir)

    assert dataset.mask_values == [0, 1]
    assert torch.equal(dataset[0]["mask"], torch.from_numpy(masks["a"]).long())


def test_grey_index_masks_map_sorted_values_to_consecutive_classes(tmp_path: Path, cache_dir: Path) -> None:
    masks = {"a": index_mask(0, [0, 2, 7]), "b": index_mask(1, [0, 2])}
    dataset = build(*write_dataset(tmp_path, masks), cache_dir, n_classes=3)

    assert dataset.mask_values == [0, 2, 7]
    expected = np.searchsorted([0, 2, 7], masks["a"])
    assert torch.equal(dataset[0]["mask"], torch.from_numpy(expected))


def test_rgb_colour_masks_use_colour_lists(tmp_path: Path, cache_dir: Path) -> None:
    palette = np.array([[0, 0, 0], [255, 0, 0], [0, 0, 255]], dtype=np.uint8)
    indices = index_mask(0, [0, 1, 2])
    images_dir, masks_dir = write_dataset(tmp_path, {"a": palette[indices]})
    dataset = build(images_dir, masks_dir, cache_dir, n_classes=3)

    assert dataset.mask_values == [[0, 0, 0], [0, 0, 255], [255, 0, 0]]
    # Sorted colours: black → 0, blue → 1, red → 2.
    expected = np.array([0, 2, 1])[indices]
    assert torch.equal(dataset[0]["mask"], torch.from_numpy(expected))


def test_rgba_mask_ignores_alpha_and_palette_png_uses_indices(tmp_path: Path, cache_dir: Path) -> None:
    indices = index_mask(0, [0, 1])
    rgba = np.zeros((HEIGHT, WIDTH, 4), dtype=np.uint8)
    rgba[..., 1] = indices * 200
    rgba[..., 3] = np.random.default_rng(0).integers(0, 256, (HEIGHT, WIDTH))
    images_dir, masks_dir = write_dataset(tmp_path / "rgba", {"a": rgba})
    assert build(images_dir, masks_dir, cache_dir).mask_values == [[0, 0, 0], [0, 200, 0]]

    images_dir, masks_dir = write_dataset(tmp_path / "palette", {"a": indices})
    palette_mask = Image.fromarray(indices)
    palette_mask.putpalette([10, 20, 30, 200, 100, 50])  # colours that are not the indices
    palette_mask.save(masks_dir / "a.png")
    assert build(images_dir, masks_dir, cache_dir).mask_values == [0, 1]


def test_16_bit_grey_masks_keep_their_values(tmp_path: Path, cache_dir: Path) -> None:
    mask = index_mask(0, [0, 300, 40000]).astype(np.uint16)
    images_dir, masks_dir = write_dataset(tmp_path, {"a": mask})
    dataset = build(images_dir, masks_dir, cache_dir)

    assert Image.open(masks_dir / "a.png").mode.startswith("I")
    assert dataset.mask_values == [0, 300, 40000]
    assert torch.equal(dataset[0]["mask"], torch.from_numpy(np.searchsorted([0, 300, 40000], mask)))


def test_npy_and_pt_images_and_masks(tmp_path: Path, cache_dir: Path) -> None:
    images_dir, masks_dir = tmp_path / "imgs", tmp_path / "masks"
    images_dir.mkdir()
    masks_dir.mkdir()
    rgb = random_image(0)
    grey_float = np.linspace(0.0, 1.0, WIDTH * HEIGHT, dtype=np.float32).reshape(HEIGHT, WIDTH)
    np.save(images_dir / "rgb.npy", rgb)
    np.save(images_dir / "float.npy", grey_float)
    torch.save(torch.from_numpy(rgb).permute(2, 0, 1).contiguous(), images_dir / "chw.pt")
    bool_mask = index_mask(0, [0, 1]).astype(bool)
    for name in ("rgb", "float", "chw"):
        np.save(masks_dir / f"{name}.npy", bool_mask)
    dataset = build(images_dir, masks_dir, cache_dir)

    assert dataset.ids == ["chw", "float", "rgb"]
    assert dataset.mask_values == [0, 255]  # bool arrays load as 0/255 grey
    rgb_tensor = torch.from_numpy(rgb).permute(2, 0, 1).float() / 255
    assert torch.equal(dataset[2]["image"], rgb_tensor)
    assert torch.equal(dataset[0]["image"], rgb_tensor)  # a CxHxW tensor is recognised
    float_image = dataset[1]["image"]  # a grey array among RGB ones: converted to RGB (tested on its own below)
    assert float_image.shape == (3, HEIGHT, WIDTH)
    for channel in float_image:
        assert torch.allclose(channel, torch.from_numpy(grey_float), atol=0.5 / 255 + 1e-6)
    assert torch.equal(dataset[1]["mask"], torch.from_numpy(bool_mask.astype(np.int64)))


def test_load_image_rejects_unusable_arrays(tmp_path: Path) -> None:
    np.save(tmp_path / "flat.npy", np.zeros(5, dtype=np.uint8))
    np.save(tmp_path / "big.npy", np.full((4, 4), 2.5, dtype=np.float32))
    torch.save({"not": "a tensor"}, tmp_path / "dict.pt")
    (tmp_path / "garbage.pt").write_bytes(b"\x80\x02garbage that is not a pickle")
    with pytest.raises(DatasetError, match=r"flat\.npy holds an array of shape \(5,\)"):
        load_image(tmp_path / "flat.npy")
    with pytest.raises(DatasetError, match=r"big\.npy holds floats in \[2\.5, 2\.5\]; save float images scaled"):
        load_image(tmp_path / "big.npy")
    with pytest.raises(DatasetError, match=r"dict\.pt holds a dict, not a tensor"):
        load_image(tmp_path / "dict.pt")
    with pytest.raises(DatasetError, match=r"garbage\.pt cannot be loaded safely: it is corrupt or holds objects"):
        load_image(tmp_path / "garbage.pt")


def test_grey_images_give_one_channel(tmp_path: Path, cache_dir: Path) -> None:
    images_dir, masks_dir = write_dataset(tmp_path, {"a": index_mask(0, [0, 1])})
    grey = random_image(5, channels=1)
    Image.fromarray(grey).save(images_dir / "a.png")
    item = build(images_dir, masks_dir, cache_dir)[0]

    assert item["image"].shape == (1, HEIGHT, WIDTH)
    assert torch.equal(item["image"][0], torch.from_numpy(grey).float() / 255)


def test_hidden_files_subfolders_and_other_files_are_ignored(tmp_path: Path, cache_dir: Path) -> None:
    masks = {"a": index_mask(0, [0, 1]), "b": index_mask(1, [0, 1])}
    images_dir, masks_dir = write_dataset(tmp_path, masks)
    os.rename(images_dir / "b.png", images_dir / "b.PNG")  # extensions match in any case
    for folder in (images_dir, masks_dir):
        (folder / ".DS_Store").write_bytes(b"\0\1junk")
        (folder / "._a.png").write_bytes(b"AppleDouble junk")
        (folder / "notes.txt").write_text("not an image")
        (folder / "nested").mkdir()
        Image.fromarray(random_image(9)).save(folder / "nested" / "c.png")
    dataset = build(images_dir, masks_dir, cache_dir)

    assert dataset.ids == ["a", "b"]
    assert ".png" in IMAGE_EXTENSIONS and ".npy" in IMAGE_EXTENSIONS


# ---------------------------------------------------------------- scale and preprocess


def test_scale_resizes_odd_sizes_like_milesial(tmp_path: Path, cache_dir: Path) -> None:
    mask = index_mask(0, [0, 1, 2], size=(47, 31))
    images_dir, masks_dir = write_dataset(tmp_path, {"a": mask})
    dataset = build(images_dir, masks_dir, cache_dir, scale=0.5)
    item = dataset[0]

    assert dataset.scale == 0.5
    assert item["image"].shape == (3, 15, 23) and item["image"].dtype == torch.float32
    assert item["mask"].shape == (15, 23) and item["mask"].dtype == torch.int64
    pil_mask = np.asarray(Image.fromarray(mask).resize((23, 15), Image.NEAREST))
    assert torch.equal(item["mask"], torch.from_numpy(pil_mask.astype(np.int64)))
    pil_image = np.asarray(Image.open(images_dir / "a.png").resize((23, 15), Image.BICUBIC), dtype=np.float32)
    difference = np.abs(item["image"].permute(1, 2, 0).numpy() * 255 - pil_image).max()
    assert difference <= 1.0 + 1e-3  # torchvision's uint8 bicubic agrees with PIL's within one level


def test_preprocess_is_milesial_compatible_and_matches_items(tmp_path: Path, cache_dir: Path) -> None:
    mask = index_mask(0, [0, 255], size=(40, 30))
    images_dir, masks_dir = write_dataset(tmp_path, {"a": mask})
    dataset = build(images_dir, masks_dir, cache_dir, scale=0.75)

    image = BasicDataset.preprocess(dataset.mask_values, Image.open(images_dir / "a.png"), 0.75, is_mask=False)
    classes = BasicDataset.preprocess(dataset.mask_values, Image.open(masks_dir / "a.png"), 0.75, is_mask=True)
    assert image.dtype == np.float32 and image.shape == (3, 22, 30)
    assert classes.dtype == np.int64 and classes.shape == (22, 30) and set(np.unique(classes)) == {0, 1}
    item = dataset[0]
    assert np.array_equal(item["image"].numpy(), image)
    assert np.array_equal(item["mask"].numpy(), classes)
    grey = BasicDataset.preprocess([0, 1], Image.fromarray(random_image(1, channels=1)), 1.0, is_mask=False)
    assert grey.shape == (1, HEIGHT, WIDTH)


@pytest.mark.parametrize("scale", [0.0, -0.5, 1.5])
def test_scale_outside_unit_interval_is_refused(tmp_path: Path, scale: float) -> None:
    with pytest.raises(ConfigError, match=r"scale must be in \(0, 1\]"):
        BasicDataset(tmp_path, tmp_path, scale=scale)


def test_scale_that_shrinks_an_image_to_nothing_fails_at_construction(tmp_path: Path, cache_dir: Path) -> None:
    masks = {"big": index_mask(0, [0, 1]), "thin": index_mask(1, [0, 1], size=(48, 3))}
    images_dir, masks_dir = write_dataset(tmp_path, masks)
    with pytest.raises(DatasetError, match=r"scale 0\.25 shrinks 1 image\(s\) to zero pixels: thin\.png \(48x3\)"):
        build(images_dir, masks_dir, cache_dir, scale=0.25)


# ---------------------------------------------------------------- bad data


def test_missing_folder(tmp_path: Path, cache_dir: Path) -> None:
    (tmp_path / "masks").mkdir()
    with pytest.raises(DatasetError, match=r"image folder .*nowhere does not exist"):
        build(tmp_path / "nowhere", tmp_path / "masks", cache_dir)


def test_empty_image_folder(tmp_path: Path, cache_dir: Path) -> None:
    (tmp_path / "imgs").mkdir()
    (tmp_path / "masks").mkdir()
    (tmp_path / "imgs" / ".gitkeep").touch()
    with pytest.raises(DatasetError, match=r"no images in .*imgs \(looked for .*\.jpg.*hidden files"):
        build(tmp_path / "imgs", tmp_path / "masks", cache_dir)


def test_images_without_masks_are_listed_and_counted(tmp_path: Path, cache_dir: Path) -> None:
    masks = {f"im{i}": index_mask(i, [0, 1]) for i in range(8)}
    images_dir, masks_dir = write_dataset(tmp_path, masks)
    for i in range(1, 8):
        (masks_dir / f"im{i}.png").unlink()
    with pytest.raises(
        DatasetError,
        match=r"7 of 8 images in .* have no mask named <id>\.<ext> .*: im1\.png, im2\.png, im3\.png, im4\.png, "
        r"im5\.png, \.\.\. \(2 more\); add their masks",
    ):
        build(images_dir, masks_dir, cache_dir)


def test_carvana_named_masks_with_plain_dataset_suggest_the_suffix(tmp_path: Path, cache_dir: Path) -> None:
    images_dir, masks_dir = write_dataset(tmp_path, {"a": index_mask(0, [0, 1])}, mask_suffix="_mask", mask_ext=".gif")
    with pytest.raises(DatasetError, match=r"use CarvanaDataset or mask_suffix='_mask'"):
        build(images_dir, masks_dir, cache_dir)
    assert detect_mask_suffix(images_dir, masks_dir) == "_mask"


def test_detect_mask_suffix_plain_names(tmp_path: Path) -> None:
    images_dir, masks_dir = write_dataset(tmp_path, {"a": index_mask(0, [0, 1]), "b": index_mask(1, [0, 1])})
    assert detect_mask_suffix(images_dir, masks_dir) == ""


def test_two_images_with_the_same_id(tmp_path: Path, cache_dir: Path) -> None:
    images_dir, masks_dir = write_dataset(tmp_path, {"a": index_mask(0, [0, 1])})
    Image.fromarray(random_image(3)).save(images_dir / "a.jpg")
    with pytest.raises(
        DatasetError, match=r"1 image name\(s\) in .* exist with several extensions \(a\.jpg and a\.png\)"
    ):
        build(images_dir, masks_dir, cache_dir)


def test_mask_size_differs_from_image(tmp_path: Path, cache_dir: Path) -> None:
    masks = {"a": index_mask(0, [0, 1]), "b": index_mask(1, [0, 1])}
    images_dir, masks_dir = write_dataset(tmp_path, masks)
    Image.fromarray(index_mask(1, [0, 1], size=(40, 32))).save(masks_dir / "b.png")
    with pytest.raises(
        DatasetError,
        match=r"1 mask\(s\) differ in size from their image: mask b\.png is 40x32 but image b\.png is 48x32",
    ):
        build(images_dir, masks_dir, cache_dir)


def test_zero_byte_file(tmp_path: Path, cache_dir: Path) -> None:
    images_dir, masks_dir = write_dataset(tmp_path, {"a": index_mask(0, [0, 1])})
    (masks_dir / "a.png").write_bytes(b"")
    with pytest.raises(DatasetError, match=r"1 file\(s\) are empty \(0 bytes\).*a\.png; copy them again"):
        build(images_dir, masks_dir, cache_dir)


@pytest.mark.parametrize("which", ["imgs", "masks"])
def test_corrupt_file(tmp_path: Path, cache_dir: Path, which: str) -> None:
    images_dir, masks_dir = write_dataset(tmp_path, {"a": index_mask(0, [0, 1])})
    (tmp_path / which / "a.png").write_bytes(b"this is not a png file at all")
    with pytest.raises(
        DatasetError, match=rf"1 file\(s\) cannot be read as images: \S*/{which}/a\.png \(.*\); replace or delete"
    ):
        build(images_dir, masks_dir, cache_dir)


def test_mixed_colour_and_grey_masks(tmp_path: Path, cache_dir: Path) -> None:
    grey = index_mask(0, [0, 255])
    images_dir, masks_dir = write_dataset(tmp_path, {"a": grey, "b": np.stack([grey] * 3, axis=-1)})
    with pytest.raises(
        DatasetError, match=r"mix colour files \(1, e\.g\. b\.png\) and single-channel files \(1, e\.g\. a\.png\)"
    ):
        build(images_dir, masks_dir, cache_dir)


def test_void_values_need_single_channel_masks(tmp_path: Path, cache_dir: Path) -> None:
    colour = np.stack([index_mask(0, [0, 255])] * 3, axis=-1)
    images_dir, masks_dir = write_dataset(tmp_path, {"a": colour})
    with pytest.raises(
        DatasetError, match=r"--ignore-value 255 needs single-channel masks, but the masks in .* colour"
    ):
        build(images_dir, masks_dir, cache_dir, ignore_values=[255])
    assert build(images_dir, masks_dir, cache_dir).mask_values == [[0, 0, 0], [255, 255, 255]]


@pytest.mark.parametrize(("n_classes", "allowed"), [(1, 2), (2, 2), (3, 3)])
def test_more_mask_values_than_classes(tmp_path: Path, cache_dir: Path, n_classes: int, allowed: int) -> None:
    values = list(range(0, 40 * (allowed + 1), 40))
    images_dir, masks_dir = write_dataset(tmp_path, {"a": index_mask(0, values)})
    with pytest.raises(
        DatasetError,
        match=rf"contain {allowed + 1} distinct values .* but n_classes={n_classes} allows at most {allowed}; "
        rf"if each value is a class, the model needs --classes {allowed + 1}",
    ):
        build(images_dir, masks_dir, cache_dir, n_classes=n_classes)
    assert len(build(images_dir, masks_dir, cache_dir, n_classes=allowed + 1).mask_values) == allowed + 1


def test_fewer_values_than_classes_warns_that_classes_shift(tmp_path: Path, cache_dir: Path, caplog) -> None:
    images_dir, masks_dir = write_dataset(tmp_path, {"a": index_mask(0, [0, 3])})
    caplog.set_level(logging.WARNING)
    assert build(images_dir, masks_dir, cache_dir, n_classes=4).mask_values == [0, 3]
    assert (
        "contain 2 distinct values (0, 3) but n_classes=4" in caplog.text and "classes 2..3 never occur" in caplog.text
    )


def test_bad_numbers_of_classes_and_workers_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="n_classes must be at least 1, got 0"):
        BasicDataset(tmp_path, tmp_path, n_classes=0)
    with pytest.raises(ConfigError, match="scan_workers must be at least 1, got 0"):
        BasicDataset(tmp_path, tmp_path, scan_workers=0)


def test_binary_model_accepts_two_values(tmp_path: Path, cache_dir: Path) -> None:
    images_dir, masks_dir = write_dataset(tmp_path, {"a": index_mask(0, [0, 255])})
    assert build(images_dir, masks_dir, cache_dir, n_classes=1).mask_values == [0, 255]


def test_jpeg_masks_warn_and_explain_extra_values(tmp_path: Path, cache_dir: Path, caplog) -> None:
    grey = index_mask(0, [0, 255])
    images_dir, masks_dir = write_dataset(tmp_path, {"a": grey}, mask_ext=".jpg")
    caplog.set_level(logging.WARNING)
    with pytest.raises(DatasetError, match=r"re-save the JPEG masks as PNG/GIF"):
        build(images_dir, masks_dir, cache_dir, n_classes=1)
    assert "JPEG compression noise creates extra mask values" in caplog.text


def test_masks_without_images_warn(tmp_path: Path, cache_dir: Path, caplog) -> None:
    images_dir, masks_dir = write_dataset(tmp_path, {"a": index_mask(0, [0, 1])})
    Image.fromarray(index_mask(0, [0, 1])).save(masks_dir / "stray.png")
    caplog.set_level(logging.WARNING)
    assert build(images_dir, masks_dir, cache_dir).ids == ["a"]
    assert "1 mask(s) in" in caplog.text and "stray.png" in caplog.text


def test_file_that_breaks_after_construction_names_the_file(tmp_path: Path, cache_dir: Path) -> None:
    images_dir, masks_dir = write_dataset(tmp_path, {"a": index_mask(0, [0, 1])})
    dataset = build(images_dir, masks_dir, cache_dir)
    (images_dir / "a.png").write_bytes(b"garbage")
    with pytest.raises(DatasetError, match=r"cannot decode .*a\.png"):
        dataset[0]


# ---------------------------------------------------------------- mask-value cache and parallel scan


def test_second_construction_reads_the_cache_and_decodes_no_mask(tmp_path, cache_dir, monkeypatch) -> None:
    masks = {f"m{i}": index_mask(i, [0, 3, 9]) for i in range(4)}
    images_dir, masks_dir = write_dataset(tmp_path, masks)
    first = build(images_dir, masks_dir, cache_dir)
    assert len(list(cache_dir.glob("*.json"))) == 1

    def no_scan(*args, **kwargs):
        raise AssertionError("the cache hit must not scan masks")

    with monkeypatch.context() as patch:
        patch.setattr(mask_values, "_scan_pair", no_scan)
        second = build(images_dir, masks_dir, cache_dir)
    assert second.mask_values == first.mask_values == [0, 3, 9]

    # Garbage of the same size with its mtime put back (os.utime, cp -p, rsync -t): its change time moved, so the
    # key changes, and the next construction scans again and finds the garbage.
    target = masks_dir / "m2.png"
    stat = target.stat()
    target.write_bytes(b"\xff" * stat.st_size)
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(DatasetError, match=r"cannot be read as images: \S*m2\.png"):
        build(images_dir, masks_dir, cache_dir)


def test_corrupt_cache_file_is_ignored_and_rewritten(tmp_path: Path, cache_dir: Path, caplog) -> None:
    images_dir, masks_dir = write_dataset(tmp_path, {"a": index_mask(0, [0, 5])})
    build(images_dir, masks_dir, cache_dir)
    (cache_file,) = cache_dir.glob("*.json")
    cache_file.write_text('{"sha256": "0", "rows": [[[48')
    caplog.set_level(logging.WARNING)

    assert build(images_dir, masks_dir, cache_dir).mask_values == [0, 5]
    assert "Ignoring unreadable mask-value cache" in caplog.text
    rewritten = json.loads(cache_file.read_text())
    # One row per pair: image size, channels, colour, the mask's values and their pixels.
    assert rewritten["rows"] == [[[WIDTH, HEIGHT], 3, False, [0, 5], [768, 768]]]
    assert not [p for p in cache_dir.iterdir() if p.suffix == ".tmp"]


def test_unwritable_cache_only_warns(tmp_path: Path, caplog) -> None:
    images_dir, masks_dir = write_dataset(tmp_path, {"a": index_mask(0, [0, 1])})
    blocker = tmp_path / "cache-is-a-file"
    blocker.write_text("")
    caplog.set_level(logging.WARNING)
    assert build(images_dir, masks_dir, blocker).mask_values == [0, 1]
    assert "Could not write mask-value cache" in caplog.text


def test_default_cache_dir_is_outside_the_data(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert mask_values.default_cache_dir() == tmp_path / "xdg" / "unet-ddp" / "mask-values"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert mask_values.default_cache_dir() == tmp_path / "home" / ".cache" / "unet-ddp" / "mask-values"


def test_parallel_scan_matches_serial_and_reports_every_problem(tmp_path: Path, cache_dir: Path) -> None:
    count = image_files.MIN_FILES_FOR_POOL + 4
    masks = {f"m{i:02d}": index_mask(i, [0, 1 + i % 5]) for i in range(count)}
    images_dir, masks_dir = write_dataset(tmp_path, masks)
    parallel = build(images_dir, masks_dir, tmp_path / "cache-parallel", scan_workers=2)
    serial = build(images_dir, masks_dir, tmp_path / "cache-serial", scan_workers=1)
    assert parallel.mask_values == serial.mask_values == [0, 1, 2, 3, 4, 5]

    Image.fromarray(index_mask(0, [0, 1], size=(20, 20))).save(masks_dir / "m03.png")
    (masks_dir / "m07.png").write_bytes(b"not a png")
    with pytest.raises(
        DatasetError, match=r"cannot be read as images: \S*m07\.png .*differ in size .*mask m03\.png is 20x20"
    ):
        build(images_dir, masks_dir, cache_dir, scan_workers=2)


# ---------------------------------------------------------------- epochs and augmentation switch


def test_items_are_identical_without_augmentation_whatever_the_epoch(tmp_path: Path, cache_dir: Path) -> None:
    images_dir, masks_dir = write_dataset(tmp_path, {"a": index_mask(0, [0, 1])})
    dataset = build(images_dir, masks_dir, cache_dir)
    first = dataset[0]
    dataset.set_epoch(3)
    second = dataset[-1]
    assert torch.equal(first["image"], second["image"]) and torch.equal(first["mask"], second["mask"])
    with pytest.raises(ValueError, match="epoch must be >= 0"):
        dataset.set_epoch(-1)


def test_cache_with_changed_or_foreign_content_is_rescanned(tmp_path: Path, cache_dir: Path, caplog) -> None:
    images_dir, masks_dir = write_dataset(tmp_path, {"a": index_mask(0, [0, 5]), "b": index_mask(1, [0, 5])})
    build(images_dir, masks_dir, cache_dir)
    (cache_file,) = cache_dir.glob("*.json")
    good = json.loads(cache_file.read_text())
    rows = good["rows"]

    def signed(rows: list) -> dict:
        return {"sha256": hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest(), "rows": rows}

    assert signed(rows) == good
    caplog.set_level(logging.WARNING)
    bad_contents = [
        {**good, "rows": rows[:1]},  # a row lost
        {**good, "rows": [[[WIDTH, "32"], *rows[0][1:]], rows[1]]},  # a type changed
        {**good, "rows": [[rows[0][0], 2, *rows[0][2:]], rows[1]]},  # a value changed
        {**good, "rows": [[[0, HEIGHT], *rows[0][1:]], rows[1]]},
        {**good, "sha256": "0" * 64},
        {"rows": rows},
        rows,
        signed(rows[:1]),  # signed, but not one row per pair
    ]
    for bad in bad_contents:
        cache_file.write_text(json.dumps(bad, separators=(",", ":")))  # the layout written: the content decides
        caplog.clear()
        dataset = build(images_dir, masks_dir, cache_dir)
        assert "Ignoring unreadable mask-value cache" in caplog.text, bad
        assert dataset.mask_values == [0, 5] and json.loads(cache_file.read_text()) == good


def test_second_start_indexes_each_folder_once(tmp_path: Path, cache_dir: Path, monkeypatch) -> None:
    """mask_suffix=None detects the naming from the dataset's own index; an augmenting twin indexes nothing."""
    images_dir, masks_dir = write_dataset(tmp_path, {"a": index_mask(0, [0, 1])}, mask_suffix="_mask")
    from utils.datasets import image_files

    calls = []
    real_index = image_files.index_folder
    monkeypatch.setattr(
        image_files, "index_folder", lambda folder, role: calls.append(role) or real_index(folder, role)
    )
    dataset = build(images_dir, masks_dir, cache_dir, mask_suffix=None)
    twin = dataset.with_augmentation(1)
    assert calls == ["image", "mask"] and dataset.mask_suffix == "_mask"
    assert twin.ids == dataset.ids and twin[0]["image"].shape == dataset[0]["image"].shape
    assert not torch.equal(twin[0]["image"], dataset[0]["image"]) or not torch.equal(
        twin[0]["mask"], dataset[0]["mask"]
    )
