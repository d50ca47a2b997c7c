"""The data side of a training run from the flags: the sampler and the two loaders.

Built by ``utils.training.setup.build_parts`` on every rank: the sampler deals each rank its share of the epoch's
order (``utils.training.sampler``); only global rank 0 validates, so only it has a validation loader.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils.data import DataLoader, Subset

from utils.errors import ConfigError
from utils.evaluation import shard_range
from utils.hardware import SharedMemoryGuard, available_cpus, check_room, threads_per_process
from utils.launch.process_group import DistributedContext
from utils.training.config import TrainConfig
from utils.training.data import TrainData, build_train_loader, build_val_loader, default_num_workers
from utils.training.sampler import ResumableDistributedSampler

WORKERS_FIX = "--num-workers 0"
"""train.py's flag that keeps loading in the training process (see utils.hardware)."""


@dataclass
class Loaders:
    sampler: ResumableDistributedSampler
    train: DataLoader | SharedMemoryGuard
    val: DataLoader | SharedMemoryGuard | None
    """Global rank 0 only; every rank its part with --val-mode sharded."""
    num_workers: int
    """Loader processes per rank, each loader."""


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
        shuffle=True,
        foreground=data.train_foreground,
        oversample_foreground=oversample,
    )
    num_workers = config.performance.num_workers
    if num_workers is None:
        # The cost per item is measured (two items decoded) only where the default uses it: on CUDA.
        item_seconds, item_pixels = data.item_cost() if ctx.device.type == "cuda" else (None, None)
        num_workers = default_num_workers(
            ctx.device.type, threads_per_process(available_cpus(), ctx.local_world_size), item_seconds, item_pixels
        )
    if num_workers and len(data.train_set):  # the ranks of this machine share its /dev/shm
        check_room(
            data.train_set[0],
            batch_size=config.optimisation.batch_size,
            workers=num_workers,
            workers_fix=WORKERS_FIX,
            processes=ctx.local_world_size,
        )
    pin = ctx.device.type == "cuda"
    train = build_train_loader(data.train_set, sampler, config, num_workers=num_workers, pin=pin)
    val = None
    if config.launch.val_mode == "sharded" and ctx.is_distributed:
        # Every rank validates its own part (utils.evaluation.shard_range); the scores are all-reduced.
        shard = Subset(data.val_set, shard_range(len(data.val_set), rank=ctx.rank, world_size=ctx.world_size))
        val = build_val_loader(shard, config, num_workers=num_workers, pin=pin)
    elif ctx.is_main:
        val = build_val_loader(data.val_set, config, num_workers=num_workers, pin=pin)
    # A worker that cannot share its batch (a small /dev/shm) becomes one Error: line naming the fix.
    return Loaders(
        sampler=sampler,
        train=SharedMemoryGuard(train, WORKERS_FIX),
        val=SharedMemoryGuard(val, WORKERS_FIX) if val is not None else None,
        num_workers=num_workers,
    )
