"""Training configuration: one typed dataclass, its command-line parser, and validation done once, up front.

Every flag of milesial/Pytorch-UNet's ``train.py`` and of the documented DDP variant keeps its spelling and short
form (``--epochs/-e``, ``--exp_name``, ``--ddp_mode``, ...); flags with underscores also accept dashes. Errors name
the flag and say what to change; argparse's own errors are turned into the same one-line ``ConfigError``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from utils.errors import ConfigError
from utils.hardware import DEVICES, PRECISIONS
from utils.training.objective import OPTIMIZERS, SCHEDULERS

WANDB_MODES = ("online", "offline", "disabled")
RESUME_AUTO = "auto"


@dataclass
class TrainConfig:
    """Everything a training run needs; ``args`` in checkpoints is ``dataclasses.asdict`` of this."""

    epochs: int = 5
    """Last epoch number to train (epochs are numbered from ``start_from``, so ``--start_from 1`` trains this many)."""
    batch_size: int = 1
    """Images per process per optimizer micro-step; the global batch is this times world size times grad_accum."""
    learning_rate: float = 1e-5
    """Peak learning rate."""
    load: str | None = None
    """Weights to start from (fresh optimizer): our checkpoints, milesial state_dicts, 'module.'-prefixed DDP files."""
    scale: float = 0.5
    """Downscaling factor applied to images and masks, in (0, 1]."""
    validation: float = 10.0
    """Percent of the images held out for validation."""
    amp: bool = False
    """Mixed precision: fp16 with a gradient scaler on CUDA, bf16 elsewhere."""
    bilinear: bool = False
    """Bilinear upsampling instead of transposed convolutions."""
    classes: int = 2
    """Number of output classes (1 = binary with a sigmoid)."""
    exp_name: str = "unet"
    """Run name: checkpoints, metrics.jsonl and curves.png go to <checkpoint_dir>/<exp_name>/."""
    ddp_mode: bool = False
    """Train with DistributedDataParallel; needs a launcher (torchrun) or --rank/--world-size."""
    save_every: int = 1
    """Write checkpoint_epoch{N}.pth every this many epochs (0 = never; last.pth and best.pth are always written)."""
    start_from: int = 1
    """Number of the first epoch (continuing a --load run: --start_from 6 --epochs 10 trains epochs 6..10)."""
    imgs: str = "data/imgs"
    """Folder of input images."""
    masks: str = "data/masks"
    """Folder of masks (Carvana '<id>_mask' naming is detected)."""
    checkpoint_dir: str = "checkpoints"
    """Parent folder of run folders."""
    seed: int = 0
    """Seed of model initialisation, data order and augmentation."""
    deterministic: bool = False
    """Use deterministic algorithms (bit-reproducible on CPU; slower on GPU)."""
    num_workers: int | None = None
    """DataLoader worker processes per rank; None picks a default from the device and the CPU count."""
    sync_bn: bool = False
    """Synchronise BatchNorm statistics across ranks (DDP only)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    precision: str | None = None
    """fp32, bf16 or fp16 autocast; None follows --amp."""
    optimizer: str = "adamw"
    """adamw, or rmsprop (milesial's optimizer)."""
    scheduler: str = "cosine"
    """cosine (per optimizer step, to zero at the last epoch), or plateau (ReduceLROnPlateau on validation Dice)."""
    weight_decay: float = 1e-8
    """Weight decay of the optimizer (milesial's 1e-8)."""
    momentum: float = 0.999
    """RMSprop momentum (milesial's 0.999); unused by AdamW."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 = off)."""
    resume: str | None = None
    """'auto' (newest complete checkpoint of the run folder; a new run if it has none) or a path; restores all."""
    keep_last: int = 0
    """Keep only the newest K checkpoint_epoch files (0 = keep all)."""
    val_every: int = 1
    """Validate every this many epochs (the last epoch is always validated)."""
    wandb: str = "disabled"
    """Weights & Biases mode; 'disabled' sends nothing and does not import wandb."""
    augment: bool = False
    """Random horizontal flips, scaled crops and colour jitter of training images, deterministic per (seed, epoch,
    image)."""
    base_channels: int = 64
    """Width of the first UNet block (64 = the classic model)."""
    save_every_steps: int = 0
    """Also write last.pth every this many optimizer steps (0 = only at epoch ends)."""
    log_every: int = 10
    """Log loss/lr/throughput every this many optimizer steps (the only host syncs of the training loop)."""
    channels_last: bool = False
    """channels_last memory format for the model and inputs."""
    checkpointing: bool = False
    """Activation checkpointing: recompute block activations in the backward pass to save memory."""
    compile: bool = False
    """torch.compile the model."""
    max_steps: int = 0
    """Stop after this many optimizer steps in total (0 = no limit); last.pth is written so the run can resume."""
    max_nonfinite_steps: int = 5
    """Stop with an error after this many optimizer steps in a row with NaN/inf gradients (each is skipped; 0 = never
    stop). Checked at every --log-every step and checkpoint."""
    device: str = "auto"
    """auto (cuda:LOCAL_RANK if available, else MPS for one process, else CPU), cuda, mps or cpu."""
    threads: int = 0
    """CPU threads per process; 0 = this machine's cores divided by its number of training processes."""
    dist_timeout: float = 1800.0
    """Seconds a collective may wait for another rank before failing (a dead rank gives an error, not a hang)."""
    rank: int | None = None
    """Global rank for a manual launch (one process per GPU, without torchrun)."""
    world_size: int | None = None
    """World size for a manual launch."""
    dist_url: str | None = None
    """Rendezvous address for a manual launch, e.g. tcp://10.0.0.1:29500 (else MASTER_ADDR/MASTER_PORT)."""
    local_rank: int | None = None
    """Set by the legacy torch.distributed.launch; LOCAL_RANK from the environment takes precedence."""

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (only str/int/float/bool/None), safe inside a weights_only checkpoint."""
        return dataclasses.asdict(self)


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting, so every error is one line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see python train.py --help)")


def build_parser() -> argparse.ArgumentParser:
    defaults = TrainConfig()
    parser = _Parser(
        prog="train.py",
        description="Train a UNet for semantic segmentation on one device or with DistributedDataParallel.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    # The flags of milesial/Pytorch-UNet and the documented DDP script, same spelling and short forms.
    add("--epochs", "-e", type=int, default=defaults.epochs, help="Last epoch number to train")
    add("--batch-size", "-b", dest="batch_size", type=int, default=defaults.batch_size, help="Batch size per process")
    add("--learning-rate", "-l", dest="learning_rate", type=float, default=defaults.learning_rate, help="Learning rate")
    add("--load", "-f", type=str, default=None, help="Start from the weights in this file (fresh optimizer)")
    add("--scale", "-s", type=float, default=defaults.scale, help="Downscaling factor of the images, in (0, 1]")
    add(
        "--validation",
        "-v",
        type=float,
        default=defaults.validation,
        help="Percent of the data used as validation (0-100)",
    )
    add("--amp", action="store_true", help="Mixed precision (fp16 + grad scaler on CUDA, bf16 on CPU)")
    add("--bilinear", action="store_true", help="Use bilinear upsampling")
    add("--classes", "-c", type=int, default=defaults.classes, help="Number of classes")
    add("--exp_name", "--exp-name", dest="exp_name", default=defaults.exp_name, help="Run name (run folder)")
    add("--ddp_mode", "--ddp-mode", dest="ddp_mode", action="store_true", help="DistributedDataParallel training")
    add(
        "--save_every",
        "--save-every",
        dest="save_every",
        type=int,
        default=defaults.save_every,
        help="Write checkpoint_epoch{N}.pth every N epochs (0 = never)",
    )
    add(
        "--start_from",
        "--start-from",
        dest="start_from",
        type=int,
        default=defaults.start_from,
        help="Number of the first epoch",
    )
    # Data and run folder.
    add("--imgs", default=defaults.imgs, help="Folder of input images")
    add("--masks", default=defaults.masks, help="Folder of masks")
    add(
        "--checkpoint-dir",
        dest="checkpoint_dir",
        default=defaults.checkpoint_dir,
        help="Parent folder of run folders (<checkpoint-dir>/<exp_name>/)",
    )
    add(
        "--augment",
        action="store_true",
        help="Random horizontal flips, scaled crops and colour jitter of training images",
    )
    add(
        "--num-workers",
        dest="num_workers",
        type=int,
        default=None,
        help="DataLoader workers per process (default: 0 on CPU, min(8, cpus per process - 1) on GPU)",
    )
    # Reproducibility and resuming.
    add("--seed", type=int, default=defaults.seed, help="Seed of initialisation, data order and augmentation")
    add("--deterministic", action="store_true", help="Deterministic algorithms (bit-exact resume on CPU)")
    add(
        "--resume",
        nargs="?",
        const=RESUME_AUTO,
        default=None,
        metavar="auto|PATH",
        help="Resume a run: 'auto' = newest complete checkpoint of the run folder (a new run if there is none), or a "
        "checkpoint path",
    )
    add(
        "--keep-last",
        dest="keep_last",
        type=int,
        default=defaults.keep_last,
        help="Keep only the newest K checkpoint_epoch files (0 = all)",
    )
    add(
        "--save-every-steps",
        dest="save_every_steps",
        type=int,
        default=defaults.save_every_steps,
        help="Also write last.pth every N optimizer steps (0 = off)",
    )
    add(
        "--max-steps",
        dest="max_steps",
        type=int,
        default=defaults.max_steps,
        help="Stop after N optimizer steps in total (0 = no limit)",
    )
    add(
        "--max-nonfinite-steps",
        dest="max_nonfinite_steps",
        type=int,
        default=defaults.max_nonfinite_steps,
        help="Stop after N optimizer steps in a row with NaN/inf gradients, each skipped (0 = never stop)",
    )
    # Optimisation.
    add("--optimizer", choices=OPTIMIZERS, default=defaults.optimizer, help="Optimizer")
    add(
        "--scheduler",
        choices=SCHEDULERS,
        default=defaults.scheduler,
        help="cosine annealing per step, or ReduceLROnPlateau on validation Dice",
    )
    add("--weight-decay", dest="weight_decay", type=float, default=defaults.weight_decay, help="Weight decay")
    add("--momentum", type=float, default=defaults.momentum, help="RMSprop momentum")
    add(
        "--grad-clip",
        dest="grad_clip",
        type=float,
        default=defaults.grad_clip,
        help="Max global gradient norm (0 = no clipping)",
    )
    add(
        "--grad-accum",
        dest="grad_accum",
        type=int,
        default=defaults.grad_accum,
        help="Micro-batches per optimizer step",
    )
    add("--precision", choices=PRECISIONS, default=None, help="Autocast precision (default: fp32, or --amp's)")
    # Model and performance.
    add(
        "--base-channels",
        dest="base_channels",
        type=int,
        default=defaults.base_channels,
        help="Width of the first UNet block",
    )
    add("--sync-bn", dest="sync_bn", action="store_true", help="Synchronise BatchNorm across processes (DDP)")
    add("--channels-last", dest="channels_last", action="store_true", help="channels_last memory format")
    add("--checkpointing", action="store_true", help="Activation checkpointing (less memory, more compute)")
    add("--compile", action="store_true", help="torch.compile the model")
    add(
        "--threads",
        type=int,
        default=defaults.threads,
        help="CPU threads per process (0 = cores / processes on this machine)",
    )
    add("--device", choices=DEVICES, default=defaults.device, help="Device to train on")
    # Validation and logging.
    add("--val-every", dest="val_every", type=int, default=defaults.val_every, help="Validate every N epochs")
    add("--log-every", dest="log_every", type=int, default=defaults.log_every, help="Log every N optimizer steps")
    add("--wandb", choices=WANDB_MODES, default=defaults.wandb, help="Weights & Biases mode")
    # Distributed launch. torchrun needs none of these; they serve manual and legacy launches.
    add(
        "--dist-timeout",
        dest="dist_timeout",
        type=float,
        default=defaults.dist_timeout,
        help="Seconds before a collective waiting for a dead rank fails",
    )
    add("--rank", type=int, default=None, help="Global rank (manual launch without torchrun)")
    add("--world-size", dest="world_size", type=int, default=None, help="Number of processes (manual launch)")
    add("--dist-url", dest="dist_url", default=None, help="tcp://HOST:PORT (manual launch)")
    add(
        "--local-rank",
        "--local_rank",
        dest="local_rank",
        type=int,
        default=None,
        help="Set by torch.distributed.launch (LOCAL_RANK from the environment wins)",
    )
    return parser


def parse_config(argv: Sequence[str] | None = None) -> TrainConfig:
    """Parse ``argv`` (default: sys.argv[1:]) into a validated TrainConfig."""
    namespace = build_parser().parse_args(argv)
    config = TrainConfig(**vars(namespace))
    validate_config(config)
    return config


def validate_config(config: TrainConfig) -> None:
    """Reject impossible values before anything is built; every message names the flag to change."""
    _require(config.epochs >= 1, "--epochs must be at least 1")
    _require(config.batch_size >= 1, "--batch-size must be at least 1")
    _require(config.learning_rate > 0, "--learning-rate must be positive")
    _require(0 < config.scale <= 1, f"--scale must be in (0, 1], got {config.scale}")
    _require(
        0 < config.validation < 100,
        f"--validation is a percentage of the images and must be in (0, 100), got {config.validation}",
    )
    _require(config.classes >= 1, "--classes must be at least 1 (1 = binary with one logit)")
    _require(config.start_from >= 1, "--start_from must be at least 1")
    _require(
        config.start_from <= config.epochs,
        f"--start_from {config.start_from} is after --epochs {config.epochs}: --epochs is the number of the last "
        f"epoch, so pass --epochs {config.start_from + config.epochs - 1} to train {config.epochs} more epochs",
    )
    _require(config.save_every >= 0, "--save_every must be 0 (never) or positive")
    _require(config.keep_last >= 0, "--keep-last must be 0 (keep all) or positive")
    _require(config.save_every_steps >= 0, "--save-every-steps must be 0 (off) or positive")
    _require(config.max_steps >= 0, "--max-steps must be 0 (no limit) or positive")
    _require(config.max_nonfinite_steps >= 0, "--max-nonfinite-steps must be 0 (never stop) or positive")
    _require(config.grad_accum >= 1, "--grad-accum must be at least 1")
    _require(config.val_every >= 1, "--val-every must be at least 1")
    _require(config.log_every >= 1, "--log-every must be at least 1")
    _require(config.base_channels >= 1, "--base-channels must be at least 1")
    _require(config.weight_decay >= 0, "--weight-decay must not be negative")
    _require(config.grad_clip >= 0, "--grad-clip must be 0 (off) or positive")
    _require(config.threads >= 0, "--threads must be 0 (automatic) or positive")
    _require(config.dist_timeout > 0, "--dist-timeout must be positive (seconds)")
    _require(config.num_workers is None or config.num_workers >= 0, "--num-workers must not be negative")
    _require(
        bool(config.exp_name) and "/" not in config.exp_name and config.exp_name not in (".", ".."),
        f"--exp_name {config.exp_name!r} must be a plain folder name (no '/')",
    )
    _require(
        not (config.amp and config.precision == "fp32"),
        "--amp asks for mixed precision but --precision fp32 forbids it; drop one of the two",
    )
    _require(
        not (config.load and config.resume),
        "--load starts a new run from weights and --resume continues a run; pass only one of them",
    )
    _require(
        (config.rank is None) == (config.world_size is None),
        "--rank and --world-size go together (manual launch: one process per rank)",
    )
    if config.world_size is not None:
        _require(config.world_size >= 1, "--world-size must be at least 1")
        _require(0 <= config.rank < config.world_size, f"--rank must be in [0, {config.world_size - 1}]")
    _require(
        config.dist_url is None or config.rank is not None,
        "--dist-url is for manual launches and needs --rank and --world-size (torchrun sets the address itself)",
    )
    _require(
        config.dist_url is None or config.dist_url.startswith(("tcp://", "file://", "env://")),
        f"--dist-url must look like tcp://HOST:PORT, got {config.dist_url!r}",
    )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)
