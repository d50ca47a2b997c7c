"""Training data: the dataset, the train/validation split (identical on every rank) and the data loaders.

Built by ``utils.training.setup.build_parts`` on every rank: the sampler deals each rank its share of the epoch's
order (``utils.training.sampler``); with --val-mode rank0 only global rank 0 has a validation loader, with
--val-mode sharded every rank has one over its share.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils.data import Dataset, Subset

from utils.datasets.dataset import BasicDataset
from utils.datasets.splits import SplitRecord, split_dataset
from utils.errors import ConfigError
from utils.evaluation import shard_range
from utils.hardware import SharedMemoryGuard, available_cpus, guarded_loader, reuse_large_buffers, threads_per_process
from utils.launch.process_group import DistributedContext
from utils.training.config import TrainConfig
from utils.training.sampler import ResumableDistributedSampler

logger = logging.getLogger(__name__)

MAX_DEFAULT_WORKERS = 16
# What one GPU process consumes, in input pixels per second, to size its loaders: an H200 trains the base-64 UNet at
# 959x640 (2.7 TFLOP per image, forward + backward) at about 180 images/s at half its dense bf16 peak, ~1.1e8
# pixels/s; smaller inputs go proportionally faster. Overestimating costs only idle workers' memory.
GPU_PIXELS_PER_SECOND = 1.2e8


@dataclass
class TrainData:
    """The two subsets, the dataset whose epoch selects the augmentation, and what the model needs to know."""

    train_set: Subset
    val_set: Subset
    train_dataset: BasicDataset
    mask_values: list
    n_channels: int
    train_class_pixels: list[int] = field(default_factory=list)
    """Pixels of each class over the training images (full-size masks, void excluded), from the mask scan."""
    train_foreground: list[int] = field(default_factory=list)
    """Positions in ``train_set`` of the images that contain a non-background class."""
    split: SplitRecord | None = None
    """The ids on each side and the rule that made them (``split.json``, its digest in every checkpoint)."""


def build_data(config: TrainConfig) -> TrainData:
    """Datasets and split (from ``config.data``, the classes and --pixel-cache); a DatasetError/ConfigError names the
    folder or flag when the data cannot be used."""
    data = config.data
    # mask_suffix=None: detected from the same folder index the dataset builds (the folders are read once).
    plain = BasicDataset(
        data.imgs,
        data.masks,
        data.scale,
        None,
        n_classes=config.model.classes,
        pixel_cache_dir=config.performance.pixel_cache,
        ignore_values=tuple(data.ignore_values),
    )
    # The split is defined on the unaugmented dataset; the training subset reads the same files through an augmenting
    # twin that shares its index and scan.
    augmented = plain.with_augmentation(data.seed) if data.augment else plain
    train_positions, val_positions, split = split_dataset(plain.ids, data, data.imgs)
    train_set = Subset(augmented, train_positions)
    return TrainData(
        train_set=train_set,
        val_set=Subset(plain, val_positions),
        train_dataset=augmented,
        mask_values=list(plain.mask_values),
        n_channels=plain.channels,
        train_class_pixels=plain.class_pixel_counts(train_set.indices),
        train_foreground=[position for position, index in enumerate(train_set.indices) if plain.has_foreground(index)],
        split=split,
    )


def default_num_workers(device_type: str, cpus_per_process: int, measure: Callable[[], tuple[float, int]]) -> int:
    """Loader processes per rank when --num-workers is not given.

    On CPU every core already runs the model's threads: a worker process would compete with them and decoding a
    batch costs far less than a training step, so loading happens in the training process. On a GPU the CPU is free
    for decoding; one core stays with the training process, and of the others as many load as it takes to deliver
    ``GPU_PIXELS_PER_SECOND`` at the cost per item that ``measure()`` returns (``item_cost``: asked on a GPU only).
    """
    if device_type != "cuda":
        return 0
    item_seconds, item_pixels = measure()
    needed = math.ceil(item_seconds * GPU_PIXELS_PER_SECOND / item_pixels)
    return min(max(0, min(MAX_DEFAULT_WORKERS, cpus_per_process - 1)), max(1, needed))


def item_cost(train_set: Dataset) -> tuple[float, int]:
    """(seconds to load one training item in this process: decode or cache read, augmentation; pixels of one network
    input): the fastest of the first two items, so one-off set-up costs are left out."""
    timings, shape = [], torch.Size()
    for index in range(min(2, len(train_set))):
        started = time.perf_counter()
        shape = train_set[index]["image"].shape
        timings.append(time.perf_counter() - started)
    return min(timings), shape[-1] * shape[-2]


@dataclass
class Loaders:
    train: SharedMemoryGuard
    """Its ``sampler`` (a ``ResumableDistributedSampler``) selects each epoch's order; ``num_workers``: loader
    processes per rank, each loader."""
    val: SharedMemoryGuard | None
    """Global rank 0 only; every rank its part with --val-mode sharded."""
    val_sharded: bool
    """--val-mode sharded with several processes: every rank validates its part, the scores are all-reduced."""


def build_loaders(config: TrainConfig, ctx: DistributedContext, data: TrainData) -> Loaders:
    """This rank's sampler and loaders over ``data``."""
    oversample = config.data.oversample_foreground
    if oversample and not data.train_foreground:
        raise ConfigError(
            f"--oversample-foreground {oversample:g}: none of the {len(data.train_set)} training "
            f"images contains a non-background class; drop the flag or check --masks"
        )
    sampler = ResumableDistributedSampler(
        len(data.train_set),
        rank=ctx.rank,
        world_size=ctx.world_size,
        seed=config.data.seed,
        foreground=data.train_foreground,
        oversample_foreground=oversample,
    )
    cuda = ctx.device.type == "cuda"
    num_workers = config.performance.num_workers
    if num_workers is None:
        cpus = threads_per_process(available_cpus(), ctx.local_world_size)
        num_workers = default_num_workers(ctx.device.type, cpus, lambda: item_cost(data.train_set))

    def loader(dataset: Dataset, sampler: ResumableDistributedSampler | None = None) -> SharedMemoryGuard:
        # No drop_last (milesial's dropped the last partial batch). Workers copy the dataset when an epoch's iterator
        # starts, so they are never persistent: persistent ones would keep an old epoch's augmentation. The ranks of
        # this machine share its /dev/shm (guarded_loader); pinned batches copy to a GPU without blocking.
        return guarded_loader(
            dataset,
            batch_size=config.optimisation.batch_size,
            workers=num_workers,
            workers_fix="--num-workers 0",  # the flag that keeps loading in the training process
            processes=ctx.local_world_size,
            sampler=sampler,
            pin_memory=cuda,
            worker_init_fn=_init_loader_worker if num_workers else None,
            # A private generator: creating an iterator draws a base seed, which must not consume the global RNG.
            generator=torch.Generator().manual_seed(config.data.seed),
        )

    train = loader(data.train_set, sampler)
    sharded = config.launch.val_mode == "sharded" and ctx.is_distributed
    if sharded:
        # Every rank validates its own part (utils.evaluation.shard_range); the scores are all-reduced.
        val = loader(Subset(data.val_set, shard_range(len(data.val_set), rank=ctx.rank, world_size=ctx.world_size)))
    else:
        val = loader(data.val_set) if ctx.is_main else None
    return Loaders(train=train, val=val, val_sharded=sharded)


def _init_loader_worker(worker_id: int) -> None:
    # Ctrl-C reaches every process of the terminal's group and schedulers signal whole jobs: a loader worker that
    # died of it would make the graceful stop fail with "DataLoader worker exited unexpectedly". The training process
    # alone decides when to stop; its workers end with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The same megabyte-sized tensors are made for every item: reuse their memory (utils.hardware).
    reuse_large_buffers()
