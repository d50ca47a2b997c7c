"""The data side of a training run from the flags: the ``DataConfig``, the sampler and the two loaders.

Built by ``utils.training.setup.build_parts`` on every rank: the sampler deals each rank its share of the epoch's
order (``utils.training.sampler``); only global rank 0 validates, so only it has a validation loader.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils.data import DataLoader

from utils.distributed import DistributedContext
from utils.errors import ConfigError
from utils.hardware import available_cpus, threads_per_process
from utils.training.config import TrainConfig
from utils.training.data import DataConfig, TrainData, build_train_loader, build_val_loader, default_num_workers
from utils.training.sampler import ResumableDistributedSampler


@dataclass
class Loaders:
    sampler: ResumableDistributedSampler
    train: DataLoader
    val: DataLoader | None
    """Global rank 0 only."""
    num_workers: int
    """Loader processes per rank, each loader."""


def data_config(config: TrainConfig) -> DataConfig:
    return DataConfig(
        imgs=config.imgs,
        masks=config.masks,
        scale=config.scale,
        validation=config.validation,
        classes=config.classes,
        augment=config.augment,
        seed=config.seed,
        batch_size=config.batch_size,
        pixel_cache=config.pixel_cache,
        ignore_values=tuple(config.ignore_values),
    )


def build_loaders(config: TrainConfig, settings: DataConfig, ctx: DistributedContext, data: TrainData) -> Loaders:
    """This rank's sampler and loaders over ``data`` (built from ``settings``)."""
    if config.oversample_foreground and not data.train_foreground:
        raise ConfigError(
            f"--oversample-foreground {config.oversample_foreground:g}: none of the {len(data.train_set)} training "
            f"images contains a non-background class; drop the flag or check --masks"
        )
    sampler = ResumableDistributedSampler(
        len(data.train_set),
        rank=ctx.rank,
        world_size=ctx.world_size,
        seed=settings.seed,
        shuffle=True,
        foreground=data.train_foreground,
        oversample_foreground=config.oversample_foreground,
    )
    num_workers = config.num_workers
    if num_workers is None:
        num_workers = default_num_workers(
            ctx.device.type,
            threads_per_process(available_cpus(), ctx.local_world_size),
            data.item_seconds,
            data.item_pixels,
        )
    pin = ctx.device.type == "cuda"
    train = build_train_loader(data.train_set, sampler, settings, num_workers=num_workers, pin=pin)
    val = build_val_loader(data.val_set, settings, num_workers=num_workers, pin=pin) if ctx.is_main else None
    return Loaders(sampler=sampler, train=train, val=val, num_workers=num_workers)
