"""The data and startup sections: dataset construction, per-item load times with and without the pixel cache,
decoders, DataLoader throughput, and second starts over many small files.

Dataset construction runs twice over ``--n-masks`` full-size masks, each time in a fresh process, so the second figure
is a real second start reading the mask-value cache. The per-worker figures are what one loader worker (one thread)
delivers: items/s of the real dataset with augmentation on, decoding full-size files or reading the pixel cache
(``utils.datasets.pixel_cache``), set against the images/s the compute section's model consumes. The startup section
does the same two constructions over ``--startup-pairs`` tiny pairs (hard links to one drawn pair), where only the
per-file costs of indexing and the cache key remain.
"""

from __future__ import annotations

import copy
import math
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from scripts.bench.context import Context, ratio
from scripts.bench.demo_data import DISTINCT_FULL_SIZE, ensure_demo_data, write_linked_dataset, write_small_pairs
from scripts.bench.processes import call_worker
from utils.hardware import available_cpus


def run_data(ctx: Context) -> dict[str, Any]:
    config = ctx.config
    demo = ensure_demo_data(ctx)
    full = write_linked_dataset(
        ctx.work_dir / "full-size", config.n_masks, config.full_size, distinct=DISTINCT_FULL_SIZE
    )
    cache_dir = ctx.work_dir / "mask-value-cache"
    shutil.rmtree(cache_dir, ignore_errors=True)
    first, second = _two_constructions(ctx, full, cache_dir, "dataset construction")
    ctx.row(
        "data",
        f"dataset construction, {config.n_masks} masks {config.full_size[0]}x{config.full_size[1]}",
        f"{first['seconds']:.3g} s / {second['seconds']:.3g} s",
        f"first (scan) / second (cache, best of {SECOND_STARTS}): {first['seconds'] / second['seconds']:.0f}x faster",
    )
    scaling = _first_construction_scaling(ctx, full)
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
    load["per_worker_items_per_s_uncached"] = 1000 / load["item_ms_full_augmented"]
    load["per_worker_items_per_s_cached"] = 1000 / load["cached_item_ms_full_augmented"]
    load["per_worker_cached_over_uncached"] = load["item_ms_full_augmented"] / load["cached_item_ms_full_augmented"]
    _data_rows(ctx, load, consumption)
    return {
        "n_masks": config.n_masks,
        "full_size": list(config.full_size),
        "build_first_s": first["seconds"],
        "build_second_s": second["seconds"],
        "build_first_s_by_processes": scaling,
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
    uncached, cached = load["per_worker_items_per_s_uncached"], load["per_worker_items_per_s_cached"]
    if consumption:
        note = (
            f"the {config.precisions[0]} model consumes {consumption:.3g} img/s at {config.size[0]}x{config.size[1]}: "
            f"{math.ceil(consumption / uncached)} worker(s) uncached, {math.ceil(consumption / cached)} cached"
        )
    else:
        note = "(run compute to compare with the model's images/s)"
    ctx.row(
        "data",
        f"loader items/s per worker, {full_shape[2]}x{full_shape[1]} + augment, uncached / pixel cache",
        f"{uncached:.3g} / {cached:.3g} items/s ({load['per_worker_cached_over_uncached']:.1f}x)",
        note,
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


def run_startup(ctx: Context) -> dict[str, Any]:
    """Second-start time over many small pairs: folder index, mask-value cache key and read, no decoding."""
    config = ctx.config
    results = []
    for count in config.startup_pairs:
        folder = write_small_pairs(ctx.work_dir / f"small-{count}", count)
        cache_dir = ctx.work_dir / f"small-{count}-value-cache"
        shutil.rmtree(cache_dir, ignore_errors=True)
        first, second = _two_constructions(ctx, folder, cache_dir, f"dataset construction, {count} small pairs")
        per_pair_us = 1e6 * second["seconds"] / count
        timings = {"first_s": first["seconds"], "second_s": second["seconds"], "second_us_per_pair": per_pair_us}
        timings["second_s_runs"] = second["seconds_runs"]
        results.append({"pairs": count, **timings})
        ctx.row(
            "startup",
            f"second dataset construction, {count} small pairs (best of {SECOND_STARTS} starts)",
            f"{second['seconds']:.3g} s ({per_pair_us:.1f} us/pair)",
            f"first (mask scan in a process pool): {first['seconds']:.3g} s",
        )
    return {"constructions": results}


SECOND_STARTS = 3


def _two_constructions(ctx: Context, folder: Path, cache_dir: Path, what: str) -> tuple[dict, dict]:
    """Build the dataset in fresh processes: the mask scan, then starts that read its cache (the best of three,
    their times kept in ``seconds_runs``: see ``_per_item_seconds`` on why the best)."""
    config = ctx.config
    spec = {"imgs": str(folder / "imgs"), "masks": str(folder / "masks"), "cache_dir": str(cache_dir)}
    first = call_worker("data-build", spec, threads=config.threads, config=config, log_dir=ctx.log_dir)
    ctx.remember_memory(f"{what} (first)", first)
    seconds = []
    for _ in range(SECOND_STARTS):
        second = call_worker("data-build", spec, threads=config.threads, config=config, log_dir=ctx.log_dir)
        seconds.append(second["seconds"])
    ctx.remember_memory(f"{what} (second)", second)
    return first, {**second, "seconds": min(seconds), "seconds_runs": seconds}


SCAN_PROCESSES = (1, 2)


def _first_construction_scaling(ctx: Context, folder: Path) -> dict[str, float]:
    """The first construction (the mask scan, nothing cached) with 1 and 2 scan processes, each in a fresh process
    with an empty cache: whether the scan a first start pays scales with processes."""
    config = ctx.config
    seconds = {}
    for processes in SCAN_PROCESSES:
        cache_dir = ctx.work_dir / f"mask-value-cache-{processes}"
        shutil.rmtree(cache_dir, ignore_errors=True)
        spec = {
            "imgs": str(folder / "imgs"),
            "masks": str(folder / "masks"),
            "cache_dir": str(cache_dir),
            "scan_workers": processes,
        }
        run = call_worker("data-build", spec, threads=1, config=config, log_dir=ctx.log_dir)
        seconds[str(processes)] = run["seconds"]
    one, two = (seconds[str(p)] for p in SCAN_PROCESSES)
    ctx.row(
        "data",
        f"first dataset construction, {config.n_masks} masks, 1 / 2 scan processes",
        f"{one:.3g} s / {two:.3g} s",
        f"{one / two:.2f}x with 2 processes ({available_cpus()} CPUs available)",
    )
    return seconds


def build_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Construct a CarvanaDataset once (mask scan, or its cache when one matches)."""
    from utils.datasets.dataset import CarvanaDataset

    started = time.perf_counter()
    dataset = CarvanaDataset(
        spec["imgs"], spec["masks"], 1.0, cache_dir=spec["cache_dir"], scan_workers=spec.get("scan_workers")
    )
    return {"seconds": time.perf_counter() - started, "n_items": len(dataset)}


def load_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Per-item load times, decoder comparisons, a pre-resized uint8 cache, and DataLoader throughput."""
    from torch.utils.data import DataLoader

    from utils.datasets.dataset import BasicDataset, CarvanaDataset
    from utils.datasets.image_files import detect_mask_suffix
    from utils.hardware import reuse_large_buffers

    result: dict[str, Any] = {}
    # Loader worker processes run one thread each (PyTorch sets that) and reuse their buffers (train.py's worker
    # initialisation); the per-item figures do the same.
    torch.set_num_threads(1)
    result["reuse_large_buffers"] = reuse_large_buffers()
    demo = BasicDataset(
        spec["demo_imgs"], spec["demo_masks"], spec["scale"], detect_mask_suffix(spec["demo_imgs"], spec["demo_masks"])
    )
    full = CarvanaDataset(spec["full_imgs"], spec["full_masks"], spec["full_scale"], cache_dir=spec["cache_dir"])
    result["item_ms_demo"] = 1000 * _per_item_seconds(demo, spec["items"])
    result["item_ms_full"] = 1000 * _per_item_seconds(full, spec["items"])
    result["item_shape_demo"] = list(demo[0]["image"].shape)
    result["item_shape_full"] = list(full[0]["image"].shape)
    result["decode"] = _decoder_times(Path(spec["full_imgs"]), Path(spec["full_masks"]), spec["items"])
    with tempfile.TemporaryDirectory(prefix="unet-bench-pixels-") as cache:
        for label, dataset in (("demo", demo), ("full", full)):
            result.update(_pixel_cache_figures(label, dataset, Path(cache), spec["items"]))

    torch.set_num_threads(spec["threads"])  # a loader without workers decodes in the training process
    loaders = []
    for workers in spec["loader_workers"]:
        loader = DataLoader(demo, batch_size=spec["batch_size"], shuffle=True, num_workers=workers, drop_last=True)
        loaders.append({"num_workers": workers, **_loader_rate(loader, spec["loader_batches"])})
    result["loader"] = loaders
    return result


def _per_item_seconds(dataset: Any, count: int, passes: int = 3) -> float:
    """Seconds per item over ``count`` items, the best of ``passes`` passes.

    The best pass, as ``timeit`` reports: on a machine shared with other work a pass is only ever slowed down by
    the others, so the fastest is the closest to what the code costs on a core of its own.
    """
    dataset[0]  # first-use costs (imports, codec set-up) are not per-item costs
    best = math.inf
    for _ in range(passes):
        started = time.perf_counter()
        for index in range(count):
            dataset[index % len(dataset)]
        best = min(best, (time.perf_counter() - started) / count)
    return best


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


def _pixel_cache_figures(label: str, dataset: Any, folder: Path, count: int) -> dict[str, float]:
    """Per-item milliseconds of ``dataset`` through its pixel cache: filling it, then reading it, with and without
    augmentation, against the same items decoded with augmentation (what a first epoch's worker does)."""
    from utils.datasets.dataset import PixelCache

    cached = copy.copy(dataset)
    cached.pixel_cache = None
    augmented = cached.with_augmentation(0)
    figures = {f"item_ms_{label}_augmented": 1000 * _per_item_seconds(augmented, count)}
    cached.pixel_cache = PixelCache(folder / label, scale=dataset.scale, channels=dataset.channels)
    started = time.perf_counter()
    for index in range(count):
        cached.fill_pixel_cache(index % len(cached))
    figures[f"cache_fill_ms_{label}"] = 1000 * (time.perf_counter() - started) / count
    figures[f"cached_uint8_item_ms_{label}"] = 1000 * _per_item_seconds(cached, count)
    figures[f"cached_item_ms_{label}_augmented"] = 1000 * _per_item_seconds(cached.with_augmentation(0), count)
    return figures


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
