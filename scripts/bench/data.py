"""The data section: dataset construction (scan, then cache), per-item load times, decoders, DataLoader throughput.

Dataset construction runs twice over ``--n-masks`` full-size masks, each time in a fresh process, so the second figure
is a real second start reading the mask-value cache (it replaces the former ``scripts/measure_dataset_build.py``).
"""

from __future__ import annotations

import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from scripts.bench.context import Context, ratio
from scripts.bench.demo_data import DISTINCT_FULL_SIZE, ensure_demo_data, write_linked_dataset
from scripts.bench.processes import call_worker


def run_data(ctx: Context) -> dict[str, Any]:
    config = ctx.config
    demo = ensure_demo_data(ctx)
    full = write_linked_dataset(
        ctx.work_dir / "full-size", config.n_masks, config.full_size, distinct=DISTINCT_FULL_SIZE
    )
    cache_dir = ctx.work_dir / "mask-value-cache"
    shutil.rmtree(cache_dir, ignore_errors=True)
    build_spec = {"imgs": str(full / "imgs"), "masks": str(full / "masks"), "cache_dir": str(cache_dir)}
    builds = []
    for attempt in ("first", "second"):
        result = call_worker("data-build", build_spec, threads=config.threads, config=config, log_dir=ctx.log_dir)
        builds.append(result)
        ctx.remember_memory(f"dataset construction ({attempt})", result)
    first, second = builds
    ctx.row(
        "data",
        f"dataset construction, {config.n_masks} masks {config.full_size[0]}x{config.full_size[1]}",
        f"{first['seconds']:.3g} s / {second['seconds']:.3g} s",
        f"first (scan) / second (cache): {first['seconds'] / second['seconds']:.0f}x faster",
    )
    load_spec = {
        "demo_imgs": str(demo / "imgs"),
        "demo_masks": str(demo / "masks"),
        "scale": config.scale,
        "full_imgs": str(full / "imgs"),
        "full_masks": str(full / "masks"),
        "full_scale": config.full_scale,
        "cache_dir": str(cache_dir),
        "items": config.items,
        "batch_size": config.batch_size,
        "loader_workers": config.loader_workers,
        "loader_batches": config.loader_batches,
    }
    load = call_worker("data-load", load_spec, threads=config.threads, config=config, log_dir=ctx.log_dir)
    ctx.remember_memory("data loading", load)
    compute = ctx.results.get("compute", {})
    consumption = compute.get(config.precisions[0], {}).get("images_per_s")
    for entry in load["loader"]:
        entry["ratio_to_model"] = ratio(entry["images_per_s"], consumption)
    _data_rows(ctx, load, consumption)
    return {
        "n_masks": config.n_masks,
        "full_size": list(config.full_size),
        "build_first_s": first["seconds"],
        "build_second_s": second["seconds"],
        "model_images_per_s": consumption,
        **{key: value for key, value in load.items() if key not in ("max_rss_mib", "isolated")},
    }


def _data_rows(ctx: Context, load: dict[str, Any], consumption: float | None) -> None:
    config = ctx.config
    demo_shape, full_shape = load["item_shape_demo"], load["item_shape_full"]
    ctx.row(
        "data",
        f"item load, demo -> {demo_shape[2]}x{demo_shape[1]} (1 thread)",
        f"{load['item_ms_demo']:.3g} ms",
        f"pre-resized uint8 cache: {load['cached_uint8_item_ms_demo']:.3g} ms",
    )
    ctx.row(
        "data",
        f"item load, {config.full_size[0]}x{config.full_size[1]} -> {full_shape[2]}x{full_shape[1]} (1 thread)",
        f"{load['item_ms_full']:.3g} ms",
        f"pre-resized uint8 cache: {load['cached_uint8_item_ms_full']:.3g} ms",
    )
    decode = load["decode"]
    ctx.row(
        "data",
        f"decode {config.full_size[0]}x{config.full_size[1]} JPEG / GIF mask, PIL",
        f"{decode['jpeg_pil_ms']:.3g} / {decode['gif_pil_ms']:.3g} ms",
        f"torchvision.io: {decode['jpeg_torchvision_ms']:.3g} / {decode['gif_torchvision_ms']:.3g} ms",
    )
    for entry in load["loader"]:
        note = (
            f"{entry['ratio_to_model']:.3g}x what the {config.precisions[0]} model consumes ({consumption:.3g} img/s)"
            if entry["ratio_to_model"] is not None
            else "(run compute to compare with the model's rate)"
        )
        ctx.row("data", f"DataLoader alone, {entry['num_workers']} workers", f"{entry['images_per_s']:.3g} img/s", note)


# ------------------------------------------------------------------------------------------------ workers


def build_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Construct a CarvanaDataset once (mask scan, or its cache when one matches)."""
    from utils.data_loading import CarvanaDataset

    started = time.perf_counter()
    dataset = CarvanaDataset(spec["imgs"], spec["masks"], 1.0, cache_dir=spec["cache_dir"])
    return {"seconds": time.perf_counter() - started, "n_items": len(dataset)}


def load_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Per-item load times, decoder comparisons, a pre-resized uint8 cache, and DataLoader throughput."""
    from torch.utils.data import DataLoader

    from utils.data_loading import BasicDataset, CarvanaDataset, detect_mask_suffix

    result: dict[str, Any] = {}
    # Loader worker processes run one thread each (PyTorch sets that); the per-item figures do the same.
    torch.set_num_threads(1)
    demo = BasicDataset(
        spec["demo_imgs"], spec["demo_masks"], spec["scale"], detect_mask_suffix(spec["demo_imgs"], spec["demo_masks"])
    )
    full = CarvanaDataset(spec["full_imgs"], spec["full_masks"], spec["full_scale"], cache_dir=spec["cache_dir"])
    result["item_ms_demo"] = 1000 * _per_item_seconds(demo, spec["items"])
    result["item_ms_full"] = 1000 * _per_item_seconds(full, spec["items"])
    result["item_shape_demo"] = list(demo[0]["image"].shape)
    result["item_shape_full"] = list(full[0]["image"].shape)
    result["decode"] = _decoder_times(Path(spec["full_imgs"]), Path(spec["full_masks"]), spec["items"])
    with tempfile.TemporaryDirectory(prefix="unet-bench-cache-") as cache:
        result["cached_uint8_item_ms_demo"] = 1000 * _cached_item_seconds(demo, Path(cache), spec["items"])
        result["cached_uint8_item_ms_full"] = 1000 * _cached_item_seconds(full, Path(cache), spec["items"])

    torch.set_num_threads(spec["threads"])  # a loader without workers decodes in the training process
    loaders = []
    for workers in spec["loader_workers"]:
        loader = DataLoader(demo, batch_size=spec["batch_size"], shuffle=True, num_workers=workers, drop_last=True)
        loaders.append({"num_workers": workers, **_loader_rate(loader, spec["loader_batches"])})
    result["loader"] = loaders
    return result


def _per_item_seconds(dataset: Any, count: int) -> float:
    dataset[0]  # first-use costs (imports, codec set-up) are not per-item costs
    started = time.perf_counter()
    for index in range(count):
        dataset[index % len(dataset)]
    return (time.perf_counter() - started) / count


def _decoder_times(images_dir: Path, masks_dir: Path, count: int) -> dict[str, float]:
    """Milliseconds to decode one full-size JPEG image and one GIF mask, with PIL and with torchvision.io."""
    import numpy as np
    import torchvision.io as tvio
    from PIL import Image

    image_path = str(sorted(images_dir.glob("*.jpg"))[0])
    mask_path = str(sorted(masks_dir.glob("*.gif"))[0])

    def pil(path: str) -> object:
        with Image.open(path) as img:
            return np.asarray(img)

    decoders: dict[str, Callable[[], object]] = {
        "jpeg_pil_ms": lambda: pil(image_path),
        "jpeg_torchvision_ms": lambda: tvio.decode_jpeg(tvio.read_file(image_path)),
        "gif_pil_ms": lambda: pil(mask_path),
        "gif_torchvision_ms": lambda: tvio.decode_gif(tvio.read_file(mask_path)),
    }
    timings = {}
    with warnings.catch_warnings():
        # torchvision 0.29 deprecates its codecs for TorchCodec and warns at every call; timing them is the point.
        warnings.simplefilter("ignore", DeprecationWarning)
        for name, decode in decoders.items():
            decode()
            started = time.perf_counter()
            for _ in range(count):
                decode()
            timings[name] = 1000 * (time.perf_counter() - started) / count
    return timings


def _cached_item_seconds(dataset: Any, folder: Path, count: int) -> float:
    """Per-item cost of reading a pre-resized uint8 image and mask (.npy) and making the training tensors."""
    import numpy as np

    item = dataset[0]
    image_file, mask_file = folder / "image.npy", folder / "mask.npy"
    np.save(image_file, (item["image"] * 255).round().to(torch.uint8).numpy())
    np.save(mask_file, item["mask"].to(torch.uint8).numpy())
    started = time.perf_counter()
    for _ in range(count):
        image = torch.from_numpy(np.load(image_file)).to(torch.float32).div_(255)
        mask = torch.from_numpy(np.load(mask_file)).to(torch.long)
    assert image.shape == item["image"].shape and mask.shape == item["mask"].shape
    return (time.perf_counter() - started) / count


def _loader_rate(loader: Any, batches: int) -> dict[str, float]:
    """Images/s of iterating ``loader`` alone, from the first batch to the last (worker start-up left out)."""
    delivered, timer_start, images, first_batch_s = 0, 0.0, 0, 0.0
    started = time.perf_counter()
    while delivered < batches:
        for batch in loader:
            delivered += 1
            if delivered == 1:
                timer_start = time.perf_counter()
                first_batch_s = timer_start - started
            else:
                images += batch["image"].shape[0]
            if delivered >= batches:
                break
    seconds = time.perf_counter() - timer_start
    return {"images_per_s": images / seconds, "first_batch_s": first_batch_s, "batches": delivered}
