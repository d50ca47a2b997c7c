"""Fill the pixel cache (``utils.datasets.dataset.PixelCache``) up front, in parallel.

    python -m utils.datasets.pixel_cache build-cache --imgs data/imgs --masks data/masks --scale 0.5 --cache DIR

Each image and mask is decoded and resized once into the folder that train.py's and predict.py's ``--pixel-cache``
then read, memory-mapped, instead of decoding. Errors end it as they end predict.py and evaluate.py
(``utils.launch.process_group.run_single_process``): a bad flag or folder is one ``Error:`` line and exit status 2.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

from torch.utils.data import DataLoader

from utils.datasets.dataset import BasicDataset
from utils.flags import FlagParser, flag
from utils.hardware import available_cpus
from utils.launch.process_group import run_single_process

logger = logging.getLogger(__name__)


@dataclass
class BuildCacheFlags:
    """The flags of ``build-cache`` (``utils.flags``: each docstring is the flag's help)."""

    imgs: str = flag(None, "--imgs", required=True)
    """folder of images"""
    masks: str = flag(None, "--masks", required=True)
    """folder of masks"""
    scale: float = flag(0.5, "--scale")
    """the training --scale (default 0.5)"""
    cache: str = flag(None, "--cache", required=True)
    """the --pixel-cache folder"""
    channels: int | None = flag(None, "--channels")
    """model input channels (default: from the images)"""
    workers: int | None = flag(None, "--workers", range="[1, inf)")
    """processes (default: the CPUs available)"""


def main(argv: list[str] | None = None) -> int:
    return run_single_process(lambda: build_cache(argv), oom_fix="use fewer --workers")


def build_cache(argv: list[str] | None) -> int:
    parser = FlagParser(
        BuildCacheFlags, prog="python -m utils.datasets.pixel_cache", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "command", choices=["build-cache"], help="decode and resize every image and mask into the cache"
    )
    flags = parser.parse(argv)
    dataset = BasicDataset(
        flags.imgs, flags.masks, flags.scale, None, channels=flags.channels, pixel_cache_dir=flags.cache
    )
    workers = flags.workers or available_cpus()
    started = time.perf_counter()
    # A DataLoader over the indices whose collate_fn (run in the workers, one index at a time) fills the cache: its
    # workers inherit the dataset (or receive it once each, where they are not forked) and run one torch thread each.
    for _ in DataLoader(range(len(dataset)), batch_size=None, num_workers=workers, collate_fn=dataset.fill_pixel_cache):
        pass
    seconds = time.perf_counter() - started
    logger.info("Cached %d items in %s in %.1f s with %d process(es)", len(dataset), flags.cache, seconds, workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
