"""``python -m utils.datasets.pixel_cache build-cache``: fill a pixel cache up front, in parallel.

Apart from the cache (``utils.datasets.pixel_cache``) because it builds a dataset, and the dataset uses the cache.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from utils.cli import print_error, setup_logging
from utils.datasets import pixel_cache
from utils.datasets.dataset import BasicDataset
from utils.datasets.image_files import pool_context, pool_map
from utils.errors import USER_ERROR_EXIT_CODE, ConfigError, UserError
from utils.hardware import available_cpus

logger = logging.getLogger(__name__)


def build_cache(dataset, workers: int) -> tuple[int, float]:
    """Fill ``dataset``'s pixel cache (a ``BasicDataset`` made with ``pixel_cache_dir``); returns (items, seconds)."""
    started = time.perf_counter()
    global _BUILD_DATASET
    _BUILD_DATASET = dataset  # inherited by the forked workers, not pickled per task
    if pool_context().get_start_method() != "fork":
        # Without fork the workers could not inherit the dataset (and pickling it per task would cost more than the
        # decoding it saves): fill serially.
        workers = 1
    pool_map(_fill_one, range(len(dataset)), workers, initializer=_one_thread, min_items=2)
    return len(dataset), time.perf_counter() - started


_BUILD_DATASET = None


def _one_thread() -> None:
    torch.set_num_threads(1)


def _fill_one(index: int) -> None:
    _BUILD_DATASET.fill_pixel_cache(index)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m utils.datasets.pixel_cache", description=pixel_cache.__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build-cache", help="decode and resize every image and mask into the cache")
    build.add_argument("--imgs", required=True, help="folder of images")
    build.add_argument("--masks", required=True, help="folder of masks")
    build.add_argument("--scale", type=float, default=0.5, help="the training --scale (default 0.5)")
    build.add_argument("--cache", required=True, help="the --pixel-cache folder")
    build.add_argument("--channels", type=int, default=None, help="model input channels (default: from the images)")
    build.add_argument("--workers", type=int, default=None, help="processes (default: the CPUs available)")
    args = parser.parse_args(argv)
    setup_logging(0, 1)
    try:
        dataset = BasicDataset(
            args.imgs, args.masks, args.scale, None, channels=args.channels, pixel_cache_dir=args.cache
        )
        workers = args.workers if args.workers is not None else available_cpus()
        if workers < 1:
            raise ConfigError(f"--workers must be at least 1, got {workers}")
        count, seconds = build_cache(dataset, workers)
    except UserError as err:
        print_error(err)
        return USER_ERROR_EXIT_CODE
    logger.info("Cached %d items in %s in %.1f s with %d process(es)", count, args.cache, seconds, workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
