"""The pixel cache (``pixel_cache_dir=``, ``--pixel-cache``): identical batches, keys, atomic writes, full disks."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from tests.conftest import REPO_ROOT
from tests.helpers import small_tmpfs
from utils.datasets import dataset as dataset_module
from utils.datasets.dataset import BasicDataset, image_tensor
from utils.datasets.pixel_cache import main as build_cache_main
from utils.errors import ConfigError

WIDTH, HEIGHT = 96, 64
N_ITEMS = 6


def write_photos(root: Path, n_items: int = N_ITEMS, *, grey: tuple[int, ...] = ()) -> tuple[Path, Path]:
    """JPEG photos (grey for the indices in ``grey``) with palette GIF masks, Carvana-named."""
    images_dir, masks_dir = root / "imgs", root / "masks"
    images_dir.mkdir(parents=True)
    masks_dir.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for index in range(n_items):
        pixels = rng.integers(0, 256, size=(HEIGHT, WIDTH, 3), dtype=np.uint8)
        photo = Image.fromarray(pixels)
        (photo.convert("L") if index in grey else photo).save(images_dir / f"car{index}.jpg", quality=90)
        band = np.arange(WIDTH)[None, :] + index * 7 > np.arange(HEIGHT)[:, None] * 2
        mask = Image.fromarray(band.astype(np.uint8))
        mask.putpalette([0, 0, 0, 255, 255, 255])
        mask.save(masks_dir / f"car{index}_mask.gif")
    return images_dir, masks_dir


@pytest.fixture
def photos(tmp_path: Path) -> tuple[Path, Path]:
    return write_photos(tmp_path / "data")


def dataset(photos: tuple[Path, Path], tmp_path: Path, pixel_cache_dir: Path | None, **kwargs) -> BasicDataset:
    return BasicDataset(*photos, 0.5, None, cache_dir=tmp_path / "values", pixel_cache_dir=pixel_cache_dir, **kwargs)


def batches(data: BasicDataset, epoch: int, num_workers: int = 0) -> list[dict[str, torch.Tensor]]:
    data.set_epoch(epoch)
    return list(DataLoader(data, batch_size=2, num_workers=num_workers))


def assert_same_batches(first: list[dict], second: list[dict]) -> None:
    assert len(first) == len(second)
    for a, b in zip(first, second, strict=True):
        assert a["image"].dtype == b["image"].dtype == torch.float32
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["mask"], b["mask"])


def forbid_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(path):
        raise AssertionError(f"decoded {path} although it is cached")

    monkeypatch.setattr(dataset_module, "load_image", refuse)


def entries(folder: Path) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.endswith(".npy"))


@pytest.mark.parametrize("augment", [False, True])
def test_batches_are_bit_identical_with_and_without_the_cache(photos, tmp_path, monkeypatch, augment) -> None:
    uncached = dataset(photos, tmp_path, None)
    cached = dataset(photos, tmp_path, tmp_path / "pixels")
    if augment:
        uncached, cached = uncached.with_augmentation(3), cached.with_augmentation(3)
    expected = [batches(uncached, epoch) for epoch in (0, 1)]

    # The first epoch's loader workers decode and fill the cache; the second epoch reads it only.
    assert_same_batches(batches(cached, 0, num_workers=2), expected[0])
    assert len(entries(tmp_path / "pixels")) == 2 * N_ITEMS
    forbid_decoding(monkeypatch)
    assert_same_batches(batches(cached, 1), expected[1])
    if augment:  # the comparison means something only if augmentation changed the items
        assert not torch.equal(expected[0][0]["image"], expected[1][0]["image"])


def test_entries_are_uint8_and_memory_mapped(photos, tmp_path) -> None:
    cached = dataset(photos, tmp_path, tmp_path / "pixels")
    cached[0]
    image_info, mask_info = cached._files[cached.ids[0]]

    def refuse() -> np.ndarray:
        raise AssertionError("decoded although the entry is cached")

    image = dataset_module.cached(cached.pixel_cache, image_info, dataset_module.IMAGE, refuse)
    mask = dataset_module.cached(cached.pixel_cache, mask_info, dataset_module.MASK, refuse)
    assert isinstance(image, np.memmap) and isinstance(mask, np.memmap)
    assert image.dtype == mask.dtype == np.uint8
    assert image.shape == (HEIGHT // 2, WIDTH // 2, 3) and mask.shape == (HEIGHT // 2, WIDTH // 2)


def test_key_follows_source_file_scale_and_channels(photos, tmp_path) -> None:
    folder = tmp_path / "pixels"
    cached = dataset(photos, tmp_path, folder)
    cached[0]
    assert len(entries(folder)) == 2
    dataset(photos, tmp_path, folder)[0]
    assert len(entries(folder)) == 2, "an unchanged file must hit its entry"
    BasicDataset(*photos, 0.25, None, cache_dir=tmp_path / "values", pixel_cache_dir=folder)[0]
    assert len(entries(folder)) == 4
    dataset(photos, tmp_path, folder, channels=1)[0]
    assert len(entries(folder)) == 6

    image = photos[0] / "car0.jpg"
    Image.fromarray(np.zeros((HEIGHT, WIDTH, 3), dtype=np.uint8)).save(image)
    os.utime(image, ns=(10**18, 10**18))
    changed = dataset(photos, tmp_path, folder)
    assert changed[0]["image"].max() == 0, "a changed file must not be served from its old entry"
    assert torch.equal(changed[0]["image"], dataset(photos, tmp_path, None)[0]["image"])


def test_damaged_entry_is_decoded_again(photos, tmp_path) -> None:
    folder = tmp_path / "pixels"
    expected = dataset(photos, tmp_path, None)[0]
    dataset(photos, tmp_path, folder)[0]
    for name in entries(folder):
        (folder / name).write_bytes(b"\x93NUMPY half")
    item = dataset(photos, tmp_path, folder)[0]
    assert torch.equal(item["image"], expected["image"]) and torch.equal(item["mask"], expected["mask"])
    assert all(np.load(folder / name).size for name in entries(folder)), "damaged entries are rewritten"


def test_failed_write_leaves_no_file_and_warns_once(photos, tmp_path, monkeypatch, caplog) -> None:
    real_save = np.save

    def save_half_then_fail(handle, array, **kwargs):
        real_save(handle, array[: len(array) // 2], **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dataset_module.np, "save", save_half_then_fail)
    cached = dataset(photos, tmp_path, tmp_path / "pixels")
    with caplog.at_level(logging.WARNING):
        items = [cached[index] for index in range(N_ITEMS)]
    assert os.listdir(tmp_path / "pixels") == [".writes-failed-" + str(os.getpid())]
    warnings = [r for r in caplog.records if "Cannot write the pixel cache" in r.getMessage()]
    assert len(warnings) == 1 and "No space left on device" in warnings[0].getMessage()
    uncached = dataset(photos, tmp_path, None)
    assert all(torch.equal(item["image"], uncached[i]["image"]) for i, item in enumerate(items))


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    """A 64 KiB tmpfs: room for a few entries, then a real ENOSPC."""
    with small_tmpfs(tmp_path / "tiny", "64k") as mount_point:
        yield mount_point


def test_full_disk_degrades_to_uncached_loading_with_one_warning(tmp_path, tiny_tmpfs, caplog) -> None:
    photos = write_photos(tmp_path / "data", n_items=12)
    uncached = dataset(photos, tmp_path, None)
    cached = dataset(photos, tmp_path, tiny_tmpfs)
    with caplog.at_level(logging.WARNING):
        first = batches(cached, 0)
        second = batches(cached, 0)
    warnings = [r for r in caplog.records if "Cannot write the pixel cache" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert 0 < len(entries(tiny_tmpfs)) < 24, "some entries fit, the rest did not"
    assert not [name for name in os.listdir(tiny_tmpfs) if name.endswith(".tmp")], "no temp file is left behind"
    expected = batches(uncached, 0)
    assert_same_batches(first, expected)
    assert_same_batches(second, expected)


def test_full_disk_with_loader_workers_marks_one_failure(tmp_path, tiny_tmpfs) -> None:
    photos = write_photos(tmp_path / "data", n_items=12)
    cached = dataset(photos, tmp_path, tiny_tmpfs)
    assert_same_batches(batches(cached, 0, num_workers=2), batches(dataset(photos, tmp_path, None), 0))
    # Both workers ran out of space; the marker lets only the first of them warn.
    assert [name for name in os.listdir(tiny_tmpfs) if name.startswith(".writes-failed-")] == [
        f".writes-failed-{os.getpid()}"
    ]


def test_cache_inside_a_data_folder_is_refused(photos, tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"pixel cache .*imgs/cache is inside the data folder .*imgs; choose"):
        dataset(photos, tmp_path, photos[0] / "cache")


def test_build_cache_command_fills_every_entry_in_parallel(photos, tmp_path, monkeypatch) -> None:
    folder = tmp_path / "pixels"
    argv = ["build-cache", "--imgs", str(photos[0]), "--masks", str(photos[1]), "--scale", "0.5"]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build_cache_main([*argv, "--cache", str(folder), "--workers", "2"]) == 0
    assert len(entries(folder)) == 2 * N_ITEMS
    expected = batches(dataset(photos, tmp_path, None).with_augmentation(1), 0)
    forbid_decoding(monkeypatch)
    assert_same_batches(batches(dataset(photos, tmp_path, folder).with_augmentation(1), 0), expected)


def test_documented_build_cache_command_runs_and_the_dataset_imports_no_command(photos, tmp_path) -> None:
    """``python -m utils.datasets.pixel_cache build-cache`` as README gives it; the dataset, which holds the cache,
    does not import the command back (run as ``__main__``, it would then exist twice)."""
    folder = tmp_path / "pixels"
    argv = ["--imgs", str(photos[0]), "--masks", str(photos[1]), "--cache", str(folder), "--workers", "1"]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    command = [sys.executable, "-m", "utils.datasets.pixel_cache", "build-cache", *argv]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(entries(folder)) == 2 * N_ITEMS
    probe = "import sys, utils.datasets.dataset; print(sorted(m for m in sys.modules if m.startswith('utils.')))"
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert "utils.datasets.dataset" in loaded.stdout and "utils.datasets.pixel_cache" not in loaded.stdout


def test_build_cache_command_reports_a_bad_folder_in_one_line(tmp_path, capsys) -> None:
    missing = str(tmp_path / "nowhere")
    argv = ["build-cache", "--imgs", missing, "--masks", str(tmp_path), "--cache", str(tmp_path / "c")]
    assert build_cache_main(argv) == 2
    assert capsys.readouterr().err.strip().startswith("Error: image folder")


# ------------------------------------------------------------------------------------- grey and RGB photos


def test_grey_photos_among_rgb_ones_are_converted_with_one_warning(tmp_path, caplog) -> None:
    photos = write_photos(tmp_path / "data", grey=(1, 4))
    with caplog.at_level(logging.WARNING):
        data = dataset(photos, tmp_path, None)
    warnings = [r.getMessage() for r in caplog.records if "converted" in r.getMessage()]
    assert len(warnings) == 1
    assert "2 of 6 images" in warnings[0] and "are grey and are converted to RGB for a 3-channel model" in warnings[0]
    assert "car1.jpg, car4.jpg" in warnings[0]
    assert data.channels == 3
    grey = data[1]["image"]
    assert grey.shape == (3, HEIGHT // 2, WIDTH // 2)
    assert torch.equal(grey[0], grey[1]) and torch.equal(grey[1], grey[2])
    batch = next(iter(DataLoader(data, batch_size=N_ITEMS)))  # a mixed folder batches (it used to fail to stack)
    assert batch["image"].shape == (N_ITEMS, 3, HEIGHT // 2, WIDTH // 2)


def test_rgb_photos_for_a_grey_model_are_converted(tmp_path, caplog) -> None:
    photos = write_photos(tmp_path / "data", grey=(0, 1, 2, 3))
    with caplog.at_level(logging.WARNING):
        majority = dataset(photos, tmp_path, None)
    assert majority.channels == 1 and "2 of 6 images" in caplog.text and "converted to grey" in caplog.text
    forced = dataset(photos, tmp_path, None, channels=1)
    with Image.open(photos[0] / "car5.jpg") as img:
        expected = image_tensor(img.convert("L"), 0.5)
    assert torch.equal(forced[5]["image"], expected)


def test_channels_must_be_one_or_three(photos, tmp_path) -> None:
    with pytest.raises(ConfigError, match="channels must be 1 .grey. or 3 .RGB., got 4"):
        dataset(photos, tmp_path, None, channels=4)


def test_training_data_from_a_mixed_folder_with_the_cache(tmp_path) -> None:
    from utils.training.config import parse_config
    from utils.training.data import build_data, item_cost

    photos = write_photos(tmp_path / "data", grey=(2,))
    folders = ["--imgs", str(photos[0]), "--masks", str(photos[1]), "--pixel-cache", str(tmp_path / "pixels")]
    config = parse_config([*folders, "--scale", "0.5", "--validation", "34", "--augment"])
    data = build_data(config)
    assert data.n_channels == 3 and data.train_dataset.pixel_cache is not None
    assert not (tmp_path / "pixels").exists(), "nothing is decoded before it is needed"
    seconds, pixels = item_cost(data.train_set)
    assert seconds > 0 and pixels == (WIDTH // 2) * (HEIGHT // 2)
    assert entries(tmp_path / "pixels"), "measuring the first items cached them"


def test_train_py_on_a_mixed_folder_with_the_pixel_cache(tmp_path, capsys) -> None:
    from tests.conftest import SyntheticData, TrainRunner

    images_dir, masks_dir = write_photos(tmp_path / "data", grey=(1,))
    runner = TrainRunner(SyntheticData(images_dir, masks_dir, N_ITEMS), tmp_path / "runs")
    folder = tmp_path / "pixels"
    flags = ("-e", "1", "--scale", "0.5", "--validation", "20", "--augment", "--pixel-cache", str(folder))
    assert runner.main("mixed", *flags) == 0
    out = capsys.readouterr().out
    assert out.count("are grey and are converted to RGB") == 1, out
    assert len(entries(folder)) == 2 * N_ITEMS, "the first epoch cached every item"


def test_loader_workers_follow_the_measured_cost_per_item() -> None:
    from utils.training.data import GPU_PIXELS_PER_SECOND, MAX_DEFAULT_WORKERS, default_num_workers

    pixels = 959 * 640
    per_worker = GPU_PIXELS_PER_SECOND / pixels  # items/s one worker must deliver for the GPU at 1 s per item

    def unmeasured() -> tuple[float, int]:
        raise AssertionError("the cost per item is measured (two items loaded) only on a GPU")

    def workers(cpus: int, seconds: float) -> int:
        return default_num_workers("cuda", cpus, lambda: (seconds, pixels))

    assert default_num_workers("cpu", 16, unmeasured) == 0, "on CPU the model's threads own every core"
    assert workers(1, 0.07) == 0, "one core: it stays with the training process"
    assert workers(64, 10.0) == MAX_DEFAULT_WORKERS, "never more than the cap"
    uncached, cached = workers(64, 0.07), workers(64, 0.005)  # a full-size Carvana decode; read from the pixel cache
    assert uncached == math.ceil(0.07 * per_worker) == 14 and cached == math.ceil(0.005 * per_worker) == 1
    assert workers(6, 0.07) == 5, "never more than the CPUs of the process less one"
    assert workers(64, 1e-6) == 1, "at least one worker on a GPU"
