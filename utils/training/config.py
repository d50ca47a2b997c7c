"""Training configuration: one typed dataclass, its command-line parser, and validation done once, up front.

Every flag of milesial/Pytorch-UNet's ``train.py`` and of the documented DDP variant keeps its spelling and short
form (``--epochs/-e``, ``--exp_name``, ``--ddp_mode``, ...); flags with underscores also accept dashes. Errors name
the flag and say what to change; argparse's own errors are turned into the same one-line ``ConfigError``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from utils.errors import ConfigError
from utils.hardware import DEVICES, PRECISIONS
from utils.training.objective import CLASS_WEIGHTS_AUTO, OPTIMIZERS, SCHEDULERS

WANDB_MODES = ("online", "offline", "disabled")
RESUME_AUTO = "auto"


@dataclass
class TrainConfig:
    """Everything a training run needs; ``args`` in checkpoints is ``dataclasses.asdict`` of this."""

    epochs: int = 5
    """Number of epochs to train: ``--epochs E --start_from S`` trains epochs S..S+E-1, as the documented DDP script."""
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
    """Number of the first epoch (continuing a --load run: --start_from 6 --epochs 5 trains epochs 6..10)."""
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
    pixel_cache: str | None = None
    """Folder of decoded, resized pixels filled by the first epoch's loaders and memory-mapped after; None: off."""
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
    ignore_values: list[int] = field(default_factory=list)
    """Void mask values (--ignore-value, repeatable, e.g. 255): not classes; left out of the loss and the metrics."""
    class_weights: str | None = None
    """Cross-entropy class weights: 'auto' (inverse frequency, clipped, mean 1) or one number per class ('1,5,5')."""
    oversample_foreground: float = 0.0
    """Fraction of each rank's images drawn from images that contain a non-background class (0 = off)."""
    save_every_minutes: float = 0.0
    """Also write last.pth when this many minutes have passed since the last save (0 = off)."""
    keep_best: int = 0
    """Keep the K best states by validation Dice as best-1.pth .. best-K.pth (0 = only best.pth)."""

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (only str/int/float/bool/None), safe inside a weights_only checkpoint."""
        return dataclasses.asdict(self)


# Upper bounds of the numeric flags that have no natural one: far above any value that trains (AdamW and RMSprop
# diverge long before a learning rate of 1) but low enough that an absurd value is refused instead of silently
# destroying the weights.
MAX_LEARNING_RATE = 1.0
MAX_WEIGHT_DECAY = 1.0
MAX_DIST_TIMEOUT_S = 7 * 24 * 3600.0
MAX_SEED = 2**32 - 1  # numpy's seeds are 32-bit
MAX_MASK_VALUE = 2**32 - 1  # 32-bit grey masks are the widest the data loader reads

HELP_GROUPS = ("data", "model", "optimisation", "distributed", "checkpoints", "logging", "performance")


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
        # "--epoch 1" must not pass for --epochs: a typo gets a suggestion instead (parse_config).
        allow_abbrev=False,
    )
    groups = {name: parser.add_argument_group(name) for name in HELP_GROUPS}

    # The flags of milesial/Pytorch-UNet and the documented DDP script keep their spelling and short forms.
    data = groups["data"].add_argument
    data("--imgs", default=defaults.imgs, help="Folder of input images")
    data("--masks", default=defaults.masks, help="Folder of masks (Carvana '<id>_mask' naming is detected)")
    data("--scale", "-s", type=float, default=defaults.scale, help="Downscaling factor of the images, in (0, 1]")
    data(
        "--validation",
        "-v",
        type=float,
        default=defaults.validation,
        help="Percent of the data used as validation, in (0, 100)",
    )
    data("--augment", action="store_true", help="Random flips, scaled crops and colour jitter of training images")
    data(
        "--ignore-value",
        dest="ignore_values",
        type=int,
        action="append",
        default=defaults.ignore_values,
        metavar="V",
        help="Void mask value, not a class: left out of the loss and the metrics (repeatable; e.g. 255)",
    )
    data(
        "--oversample-foreground",
        dest="oversample_foreground",
        type=float,
        default=defaults.oversample_foreground,
        metavar="P",
        help="Fraction in [0, 1] of each process's images taken from images with a non-background class",
    )
    data(
        "--seed",
        type=int,
        default=defaults.seed,
        help=f"Seed of initialisation, data order and augmentation (0..{MAX_SEED})",
    )

    model = groups["model"].add_argument
    model("--classes", "-c", type=int, default=defaults.classes, help="Number of classes (1 = binary, sigmoid)")
    model("--bilinear", action="store_true", help="Use bilinear upsampling")
    model(
        "--base-channels",
        dest="base_channels",
        type=int,
        default=defaults.base_channels,
        help="Width of the first UNet block",
    )

    optimisation = groups["optimisation"].add_argument
    optimisation(
        "--epochs",
        "-e",
        type=int,
        default=defaults.epochs,
        help="Number of epochs to train (numbered --start_from .. --start_from + epochs - 1)",
    )
    optimisation(
        "--batch-size", "-b", dest="batch_size", type=int, default=defaults.batch_size, help="Batch size per process"
    )
    optimisation(
        "--learning-rate",
        "-l",
        dest="learning_rate",
        type=float,
        default=defaults.learning_rate,
        help=f"Peak learning rate, in (0, {MAX_LEARNING_RATE:g}]",
    )
    optimisation("--optimizer", choices=OPTIMIZERS, default=defaults.optimizer, help="Optimizer")
    optimisation(
        "--scheduler",
        choices=SCHEDULERS,
        default=defaults.scheduler,
        help="cosine annealing per step, or ReduceLROnPlateau on validation Dice",
    )
    optimisation(
        "--weight-decay",
        dest="weight_decay",
        type=float,
        default=defaults.weight_decay,
        help=f"Weight decay, in [0, {MAX_WEIGHT_DECAY:g}]",
    )
    optimisation("--momentum", type=float, default=defaults.momentum, help="RMSprop momentum, in [0, 1)")
    optimisation(
        "--grad-clip",
        dest="grad_clip",
        type=float,
        default=defaults.grad_clip,
        help="Max global gradient norm (0 = no clipping)",
    )
    optimisation(
        "--grad-accum",
        dest="grad_accum",
        type=int,
        default=defaults.grad_accum,
        help="Micro-batches per optimizer step",
    )
    optimisation(
        "--max-steps",
        dest="max_steps",
        type=int,
        default=defaults.max_steps,
        help="Stop after N optimizer steps in total (0 = no limit)",
    )
    optimisation(
        "--max-nonfinite-steps",
        dest="max_nonfinite_steps",
        type=int,
        default=defaults.max_nonfinite_steps,
        help="Stop after N optimizer steps in a row with NaN/inf gradients, each skipped (0 = never stop)",
    )
    optimisation("--deterministic", action="store_true", help="Deterministic algorithms (bit-exact resume on CPU)")
    optimisation(
        "--class-weights",
        dest="class_weights",
        default=None,
        metavar="auto|W,W,...",
        help="Cross-entropy class weights: 'auto' (inverse pixel frequency of the training images, clipped at "
        "10x the most frequent class, mean 1) or one number per class (two for --classes 1)",
    )

    distributed = groups["distributed"].add_argument
    # torchrun needs none of these but --ddp_mode; the others serve manual and legacy launches.
    distributed(
        "--ddp_mode", "--ddp-mode", dest="ddp_mode", action="store_true", help="DistributedDataParallel training"
    )
    distributed("--sync-bn", dest="sync_bn", action="store_true", help="Synchronise BatchNorm across processes")
    distributed(
        "--dist-timeout",
        dest="dist_timeout",
        type=float,
        default=defaults.dist_timeout,
        help=f"Seconds before a collective waiting for a dead rank fails, in (0, {MAX_DIST_TIMEOUT_S:g}]",
    )
    distributed("--rank", type=int, default=None, help="Global rank (manual launch without torchrun)")
    distributed("--world-size", dest="world_size", type=int, default=None, help="Number of processes (manual launch)")
    distributed("--dist-url", dest="dist_url", default=None, help="tcp://HOST:PORT (manual launch)")
    distributed(
        "--local-rank",
        "--local_rank",
        dest="local_rank",
        type=int,
        default=None,
        help="Set by torch.distributed.launch (LOCAL_RANK from the environment wins)",
    )

    checkpoints = groups["checkpoints"].add_argument
    checkpoints("--exp_name", "--exp-name", dest="exp_name", default=defaults.exp_name, help="Run name (run folder)")
    checkpoints(
        "--checkpoint-dir",
        dest="checkpoint_dir",
        default=defaults.checkpoint_dir,
        help="Parent folder of run folders (<checkpoint-dir>/<exp_name>/)",
    )
    checkpoints("--load", "-f", type=str, default=None, help="Start from the weights in this file (fresh optimizer)")
    checkpoints(
        "--start_from",
        "--start-from",
        dest="start_from",
        type=int,
        default=defaults.start_from,
        help="Number of the first epoch (with --load: continue the numbering of the run it came from)",
    )
    checkpoints(
        "--resume",
        nargs="?",
        const=RESUME_AUTO,
        default=None,
        metavar="auto|PATH",
        help="Resume a run: 'auto' = newest complete checkpoint of the run folder (a new run if there is none), or a "
        "checkpoint path",
    )
    checkpoints(
        "--save_every",
        "--save-every",
        dest="save_every",
        type=int,
        default=defaults.save_every,
        help="Write checkpoint_epoch{N}.pth when epoch N is a multiple of this (0 = never)",
    )
    checkpoints(
        "--keep-last",
        dest="keep_last",
        type=int,
        default=defaults.keep_last,
        help="Keep only the newest K checkpoint_epoch files (0 = all)",
    )
    checkpoints(
        "--save-every-minutes",
        dest="save_every_minutes",
        type=float,
        default=defaults.save_every_minutes,
        help="Also write last.pth when M minutes have passed since the last save (0 = off)",
    )
    checkpoints(
        "--keep-best",
        dest="keep_best",
        type=int,
        default=defaults.keep_best,
        help="Keep the K best states by validation Dice as best-1.pth .. best-K.pth (0 = best.pth only)",
    )
    checkpoints(
        "--save-every-steps",
        dest="save_every_steps",
        type=int,
        default=defaults.save_every_steps,
        help="Also write last.pth every N optimizer steps (0 = off)",
    )

    logs = groups["logging"].add_argument
    logs("--val-every", dest="val_every", type=int, default=defaults.val_every, help="Validate every N epochs")
    logs("--log-every", dest="log_every", type=int, default=defaults.log_every, help="Log every N optimizer steps")
    logs("--wandb", choices=WANDB_MODES, default=defaults.wandb, help="Weights & Biases mode")

    performance = groups["performance"].add_argument
    performance("--device", choices=DEVICES, default=defaults.device, help="Device to train on")
    performance("--amp", action="store_true", help="Mixed precision (fp16 + grad scaler on CUDA, bf16 on CPU)")
    performance("--precision", choices=PRECISIONS, default=None, help="Autocast precision (default: fp32, or --amp's)")
    performance(
        "--num-workers",
        dest="num_workers",
        type=int,
        default=None,
        help="DataLoader workers per process (default: 0 on CPU; on GPU from the measured cost per item, up to "
        "min(16, cpus per process - 1))",
    )
    performance(
        "--pixel-cache",
        dest="pixel_cache",
        default=None,
        metavar="DIR",
        help="Cache decoded, resized images and masks in DIR (outside the data folders; filled during the first "
        "epoch, or up front with python -m utils.datasets.pixel_cache build-cache)",
    )
    performance(
        "--threads",
        type=int,
        default=defaults.threads,
        help="CPU threads per process (0 = cores / processes on this machine)",
    )
    performance("--channels-last", dest="channels_last", action="store_true", help="channels_last memory format")
    performance("--checkpointing", action="store_true", help="Activation checkpointing (less memory, more compute)")
    performance("--compile", action="store_true", help="torch.compile the model")
    return parser


def parse_config(argv: Sequence[str] | None = None) -> TrainConfig:
    """Parse ``argv`` (default: sys.argv[1:]) into a validated TrainConfig."""
    parser = build_parser()
    namespace, unknown = parser.parse_known_args(argv)
    if unknown:
        raise ConfigError(unknown_arguments_message(parser, unknown))
    config = TrainConfig(**vars(namespace))
    validate_config(config)
    return config


def unknown_arguments_message(parser: argparse.ArgumentParser, unknown: Sequence[str]) -> str:
    """'unrecognized arguments: ...', with the closest real flag for the first unknown one ("did you mean")."""
    message = f"unrecognized arguments: {' '.join(unknown)}"
    flags = [option for action in parser._actions for option in action.option_strings]
    for argument in unknown:
        if argument.startswith("-"):
            name = argument.split("=", 1)[0]
            close = difflib.get_close_matches(name, flags, n=1, cutoff=0.6)
            if close:
                message += f"; did you mean {close[0]}?"
            break
    return f"{message} (see python train.py --help)"


def validate_config(config: TrainConfig) -> None:
    """Reject impossible values before anything is built; every message names the flag to change."""
    # Floats first: "inf" and "nan" parse as floats, and NaN passes no comparison, so finiteness is checked apart.
    _require_number(config.learning_rate, "--learning-rate", low=0, high=MAX_LEARNING_RATE, low_open=True)
    _require_number(config.scale, "--scale", low=0, high=1, low_open=True)
    _require_number(
        config.validation, "--validation", low=0, high=100, low_open=True, high_open=True, unit=" (a percentage)"
    )
    _require_number(config.weight_decay, "--weight-decay", low=0, high=MAX_WEIGHT_DECAY)
    _require_number(config.momentum, "--momentum", low=0, high=1, high_open=True)
    _require_number(config.grad_clip, "--grad-clip", low=0, high=math.inf, unit=" (0 = off)")
    _require_number(
        config.dist_timeout, "--dist-timeout", low=0, high=MAX_DIST_TIMEOUT_S, low_open=True, unit=" seconds"
    )
    _require(0 <= config.seed <= MAX_SEED, f"--seed must be in 0..{MAX_SEED}, got {config.seed}")
    _require_number(config.oversample_foreground, "--oversample-foreground", low=0, high=1)
    _require_number(config.save_every_minutes, "--save-every-minutes", low=0, high=math.inf, unit=" (0 = off)")
    _require(config.keep_best >= 0, "--keep-best must be 0 (best.pth only) or positive")
    for value in config.ignore_values:
        _require(
            0 <= value <= MAX_MASK_VALUE, f"--ignore-value must be a mask value in 0..{MAX_MASK_VALUE}, got {value}"
        )
    if config.class_weights is not None:
        parse_class_weights(config.class_weights, config.classes)
    _require(config.epochs >= 1, "--epochs must be at least 1")
    _require(config.batch_size >= 1, "--batch-size must be at least 1")
    _require(config.classes >= 1, "--classes must be at least 1 (1 = binary with one logit)")
    _require(config.start_from >= 1, "--start_from must be at least 1 (epochs are numbered from 1)")
    _require(config.save_every >= 0, "--save_every must be 0 (never) or positive")
    _require(config.keep_last >= 0, "--keep-last must be 0 (keep all) or positive")
    _require(config.save_every_steps >= 0, "--save-every-steps must be 0 (off) or positive")
    _require(config.max_steps >= 0, "--max-steps must be 0 (no limit) or positive")
    _require(config.max_nonfinite_steps >= 0, "--max-nonfinite-steps must be 0 (never stop) or positive")
    _require(config.grad_accum >= 1, "--grad-accum must be at least 1")
    _require(config.val_every >= 1, "--val-every must be at least 1")
    _require(config.log_every >= 1, "--log-every must be at least 1")
    _require(config.base_channels >= 1, "--base-channels must be at least 1")
    _require(config.threads >= 0, "--threads must be 0 (automatic) or positive")
    _require(config.num_workers is None or config.num_workers >= 0, "--num-workers must not be negative")
    _require(
        config.local_rank is None or config.local_rank >= 0,
        f"--local-rank must not be negative, got {config.local_rank}",
    )
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


def parse_class_weights(text: str, classes: int) -> tuple[float, ...] | None:
    """--class-weights as numbers, or None for 'auto' (computed from the training masks); ConfigError if malformed."""
    if text.strip().lower() == CLASS_WEIGHTS_AUTO:
        return None
    expected = 2 if classes == 1 else classes
    try:
        weights = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"--class-weights must be 'auto' or numbers separated by commas, got {text!r}") from None
    _require(
        len(weights) == expected,
        f"--class-weights {text} gives {len(weights)} weight(s) but --classes {classes} needs {expected} (one per "
        f"class{', background and foreground' if classes == 1 else ''})",
    )
    for weight in weights:
        _require_number(weight, "--class-weights", low=0, high=math.inf, low_open=True)
    return weights


def _require_number(
    value: float,
    flag: str,
    *,
    low: float,
    high: float,
    low_open: bool = False,
    high_open: bool = False,
    unit: str = "",
) -> None:
    """``value`` is finite and inside the interval, else one error naming the flag, the interval and the value."""
    above_low = value > low if low_open else value >= low
    below_high = value < high if high_open else value <= high
    if math.isfinite(value) and above_low and below_high:
        return
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if math.isinf(high):
        interval = f"{'above' if low_open else 'at least'} {low:g}"
    where = interval if math.isinf(high) else f"in {interval}"
    raise ConfigError(f"{flag} must be a finite number {where}{unit}, got {value:g}")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)
