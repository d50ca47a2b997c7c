"""Training data: the dataset, the train/validation split (identical on every rank) and the data loaders."""

from __future__ import annotations

import logging
import math
import signal
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset, Subset, random_split

from utils.data_loading import BasicDataset, detect_mask_suffix
from utils.errors import ConfigError
from utils.training.sampler import ResumableDistributedSampler

logger = logging.getLogger(__name__)

# milesial/Pytorch-UNet splits with random_split(..., generator=torch.Generator().manual_seed(0)); the same fixed seed
# keeps its validation set, and makes the split identical on every rank whatever --seed is.
SPLIT_SEED = 0
MAX_DEFAULT_WORKERS = 8


@dataclass(frozen=True)
class DataConfig:
    """Where the images are and how they are prepared and split (from --imgs, --masks, -s, -v, -c, --augment)."""

    imgs: str
    masks: str
    scale: float = 0.5
    validation: float = 10.0
    """Percent of the images held out for validation."""
    classes: int = 2
    augment: bool = False
    seed: int = 0
    """Seed of the augmentation (the split has its own fixed seed, SPLIT_SEED)."""
    batch_size: int = 1
    """Images per process per batch, for the loaders and the check that every rank gets a batch."""


@dataclass
class TrainData:
    """The two subsets, the dataset whose epoch selects the augmentation, and what the model needs to know."""

    train_set: Subset
    val_set: Subset
    train_dataset: BasicDataset
    mask_values: list
    n_channels: int


def build_data(config: DataConfig, *, world_size: int) -> TrainData:
    """Datasets and split; a DatasetError/ConfigError names the folder or flag when the data cannot be used."""
    mask_suffix = detect_mask_suffix(config.imgs, config.masks)
    # The split is defined on the unaugmented dataset; the training subset reads the same files through an augmenting
    # twin (the mask scan is cached, so building it twice costs little).
    files = (config.imgs, config.masks, config.scale, mask_suffix)
    plain = BasicDataset(*files, n_classes=config.classes, seed=config.seed)
    augmented = (
        BasicDataset(*files, n_classes=config.classes, augment=True, seed=config.seed) if config.augment else plain
    )
    n_val, n_train = split_sizes(len(plain), config.validation)
    if n_val == 0 or n_train == 0:
        raise ConfigError(
            f"--validation {config.validation:g} leaves {n_train} training and {n_val} validation images out of "
            f"{len(plain)}; choose a percentage that leaves at least one of each, or add images to {config.imgs}"
        )
    per_rank = math.ceil(n_train / world_size)
    if config.batch_size > per_rank:
        raise ConfigError(
            f"--batch-size {config.batch_size} is larger than the {per_rank} training images each of the "
            f"{world_size} process(es) gets ({n_train} in total); use --batch-size {per_rank} or less"
        )
    generator = torch.Generator().manual_seed(SPLIT_SEED)
    train_split, val_split = random_split(range(len(plain)), [n_train, n_val], generator=generator)
    n_channels = int(plain[0]["image"].shape[0])
    return TrainData(
        train_set=Subset(augmented, list(train_split)),
        val_set=Subset(plain, list(val_split)),
        train_dataset=augmented,
        mask_values=list(plain.mask_values),
        n_channels=n_channels,
    )


def split_sizes(n_images: int, validation_percent: float) -> tuple[int, int]:
    """(validation, training) image counts, rounded as milesial does."""
    n_val = int(n_images * (validation_percent / 100))
    return n_val, n_images - n_val


def default_num_workers(device_type: str, cpus_per_process: int) -> int:
    """Loader processes per rank when --num-workers is not given.

    On CPU every core already runs the model's threads: a worker process would compete with them and decoding a
    batch costs far less than a training step, so loading happens in the training process. On a GPU the CPU is free
    for decoding; one core stays with the training process.
    """
    if device_type != "cuda":
        return 0
    return max(0, min(MAX_DEFAULT_WORKERS, cpus_per_process - 1))


def build_train_loader(
    train_set: Dataset, sampler: ResumableDistributedSampler, config: DataConfig, *, num_workers: int, pin: bool
) -> DataLoader:
    return DataLoader(
        train_set,
        batch_size=config.batch_size,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin,
        drop_last=False,
        # Workers copy the dataset when an epoch's iterator starts; persistent ones would keep an old epoch's
        # augmentation.
        persistent_workers=False,
        worker_init_fn=_ignore_stop_signals if num_workers else None,
        # A private generator: creating an iterator draws a base seed, which must not consume the global RNG.
        generator=torch.Generator().manual_seed(config.seed),
    )


def build_val_loader(val_set: Dataset, config: DataConfig, *, num_workers: int, pin: bool) -> DataLoader:
    """Every validation image, in a fixed order (no drop_last: milesial's dropped the last partial batch)."""
    return DataLoader(
        val_set,
        batch_size=config.batch_size,
        shuffle=False,
        num_workers=num_workers,
        pin_memory=pin,
        drop_last=False,
        worker_init_fn=_ignore_stop_signals if num_workers else None,
        generator=torch.Generator().manual_seed(config.seed),
    )


def _ignore_stop_signals(worker_id: int) -> None:
    # Ctrl-C reaches every process of the terminal's group and schedulers signal whole jobs: a loader worker that
    # died of it would make the graceful stop fail with "DataLoader worker exited unexpectedly". The training process
    # alone decides when to stop; its workers end with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
