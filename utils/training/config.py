"""Training configuration: one typed dataclass, its command-line parser, and validation done once, up front.

Every flag of milesial/Pytorch-UNet's ``train.py`` and of the documented DDP variant keeps its spelling and short
form (``--epochs/-e``, ``--exp_name``, ``--ddp_mode``, ...); flags with underscores also accept dashes. Errors name
the flag and say what to change; argparse's own errors are turned into the same one-line ``ConfigError``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from unet import ENCODERS
from utils.class_names import parse_class_names
from utils.cli import DEVICE_HELP, device_flag
from utils.datasets.splits import SPLIT_BY_IMAGE, SPLIT_RULES, check_split_flags
from utils.errors import ConfigError
from utils.hardware import PRECISIONS
from utils.machine_bounds import check_model_fits, check_threads, check_workers
from utils.training.config_file import add_config_flag, apply_config_file
from utils.training.flags import Range, add_flags, check_ranges, flag, require_number
from utils.training.objective import CLASS_WEIGHTS_AUTO, OPTIMIZERS, SCHEDULERS

WANDB_MODES = ("online", "offline", "disabled")
VAL_MODES = ("rank0", "sharded")
REQUEUE_SIGNALS = ("USR1", "USR2", "none")
RESUME_AUTO = "auto"


# Upper bounds of the numeric flags that have no natural one: far above any value that trains (AdamW and RMSprop
# diverge long before a learning rate of 1) but low enough that an absurd value is refused instead of silently
# destroying the weights.
MAX_LEARNING_RATE = 1.0
MAX_WEIGHT_DECAY = 1.0
MAX_DIST_TIMEOUT_S = 7 * 24 * 3600.0
MAX_SEED = 2**32 - 1  # numpy's seeds are 32-bit
MAX_MASK_VALUE = 2**32 - 1  # 32-bit grey masks are the widest the data loader reads

HELP_GROUPS = ("data", "model", "optimisation", "distributed", "checkpoints", "logging", "performance")


@dataclass
class TrainConfig:
    """Everything a training run needs; ``args`` in checkpoints is ``dataclasses.asdict`` of this.

    Each field is also its flag (``utils.training.flags.flag``): spellings, help group, help and range sit beside the
    name, type and default, and the parser, the range checks and docs/TRAINING.md's flags table all follow them.
    """

    # data
    imgs: str = flag("data/imgs", "--imgs", group="data", help="Folder of input images")
    """Folder of input images."""
    masks: str = flag(
        "data/masks", "--masks", group="data", help="Folder of masks (Carvana '<id>_mask' naming is detected)"
    )
    """Folder of masks (Carvana '<id>_mask' naming is detected)."""
    scale: float = flag(
        0.5, "--scale", "-s", group="data", help="Downscaling factor of the images, in (0, 1]", range=Range(0, 1, True)
    )
    """Downscaling factor applied to images and masks, in (0, 1]."""
    validation: float = flag(
        10.0,
        "--validation",
        "-v",
        group="data",
        help="Percent of the data used as validation, in (0, 100)",
        range=Range(0, 100, low_open=True, high_open=True, note=" (a percentage)"),
    )
    """Percent of the images held out for validation."""
    augment: bool = flag(
        False, "--augment", group="data", help="Random flips, scaled crops and colour jitter of training images"
    )
    """Random horizontal flips, scaled crops and colour jitter of training images, deterministic per (seed, epoch,
    image)."""
    ignore_values: list[int] = flag(
        [],
        "--ignore-value",
        group="data",
        metavar="V",
        help="Void mask value, not a class: left out of the loss and the metrics (repeatable; e.g. 255)",
        range=Range(0, MAX_MASK_VALUE, what="a mask value"),
    )
    """Void mask values (--ignore-value, repeatable, e.g. 255): not classes; left out of the loss and the metrics."""
    oversample_foreground: float = flag(
        0.0,
        "--oversample-foreground",
        group="data",
        metavar="P",
        help="Fraction in [0, 1] of each process's images taken from images with a non-background class",
        range=Range(0, 1),
    )
    """Fraction of each rank's images drawn from images that contain a non-background class (0 = off)."""
    seed: int = flag(
        0,
        "--seed",
        group="data",
        help=f"Seed of initialisation, data order and augmentation (0..{MAX_SEED})",
        range=Range(0, MAX_SEED),
    )
    """Seed of model initialisation, data order and augmentation."""
    split_by: str = flag(
        SPLIT_BY_IMAGE,
        "--split-by",
        group="data",
        choices=SPLIT_RULES,
        help="Train/validation split: 'image' (seeded random over images) or 'prefix' (ids sharing the part before "
        "the last '_', e.g. a Carvana car's 16 views, stay on one side)",
    )
    """How the validation images are chosen (utils.datasets.splits); docs/VALIDATION.md."""
    group_pattern: str | None = flag(
        None,
        "--group-pattern",
        group="data",
        metavar="REGEX",
        help="With --split-by prefix: a regular expression whose first group is an id's group (default: the part "
        "before the last '_')",
    )
    """The group of an image id, for --split-by prefix: the first group of this pattern (``re.search``)."""
    folds: int = flag(
        0,
        "--folds",
        group="data",
        help="Cross-validation folds (0 = off; N >= 2: fold --fold validates)",
        range=Range(0),
    )
    """Number of folds; each fold trains in its own run folder ``<exp_name>-fold<K>``."""
    fold: int = flag(0, "--fold", group="data", help="The fold that validates, 0..--folds - 1", range=Range(0))
    """The fold that validates (with --folds)."""

    # model
    classes: int = flag(
        2,
        "--classes",
        "-c",
        group="model",
        help="Number of classes (1 = binary, sigmoid)",
        range=Range(1, note=" (1 = binary with one logit)"),
    )
    """Number of output classes (1 = binary with a sigmoid)."""
    bilinear: bool = flag(False, "--bilinear", group="model", help="Use bilinear upsampling")
    """Bilinear upsampling instead of transposed convolutions."""
    base_channels: int = flag(
        64, "--base-channels", group="model", help="Width of the first UNet block", range=Range(1)
    )
    """Width of the first UNet block (64 = the classic model)."""
    encoder: str = flag(
        "unet",
        "--encoder",
        group="model",
        help="unet (milesial's UNet) or a torchvision ResNet encoder under a UNet decoder (inputs normalised with "
        "ImageNet mean/std inside the model)",
        choices=ENCODERS,
    )
    """unet (milesial's architecture) or resnet18/34/50: a torchvision ResNet under a UNet decoder."""
    encoder_weights: str | None = flag(
        None,
        "--encoder-weights",
        group="model",
        metavar="PATH",
        help="Local torchvision state dict for the ResNet encoder (e.g. resnet34-b627a593.pth; fc.* is dropped; "
        "never downloaded)",
    )
    """A local torchvision ResNet state dict loaded into the encoder of a new run (utils.training.encoder_weights)."""
    freeze_encoder_epochs: int = flag(
        0,
        "--freeze-encoder-epochs",
        group="model",
        help="Train the decoder alone for the first N epochs (the ResNet encoder's weights stay as loaded)",
        range=Range(0, zero="off"),
    )
    """Epochs at the start of the run in which the ResNet encoder's parameters are not updated."""
    deep_supervision: bool = flag(
        False,
        "--deep-supervision",
        group="model",
        help="Also supervise decoder outputs at 1/2 and 1/4 resolution (nnU-Net weights 1, 0.5, 0.25; training only)",
    )
    """Auxiliary logits at 1/2 and 1/4 resolution in the training loss (unet.deep_supervision); not at inference."""

    # optimisation
    epochs: int = flag(
        5,
        "--epochs",
        "-e",
        group="optimisation",
        help="Number of epochs to train (numbered --start_from .. --start_from + epochs - 1)",
        range=Range(1),
    )
    """Number of epochs to train: ``--epochs E --start_from S`` trains epochs S..S+E-1, as the documented DDP script."""
    batch_size: int = flag(1, "--batch-size", "-b", group="optimisation", help="Batch size per process", range=Range(1))
    """Images per process per optimizer micro-step; the global batch is this times world size times grad_accum."""
    learning_rate: float = flag(
        1e-5,
        "--learning-rate",
        "-l",
        group="optimisation",
        help=f"Peak learning rate, in (0, {MAX_LEARNING_RATE:g}]",
        range=Range(0, MAX_LEARNING_RATE, low_open=True),
    )
    """Peak learning rate."""
    optimizer: str = flag("adamw", "--optimizer", group="optimisation", help="Optimizer", choices=OPTIMIZERS)
    """adamw, or rmsprop (milesial's optimizer)."""
    scheduler: str = flag(
        "cosine",
        "--scheduler",
        group="optimisation",
        help="cosine annealing per step, poly (nnU-Net: (1 - t/T)^0.9 per step), or ReduceLROnPlateau on validation "
        "Dice",
        choices=SCHEDULERS,
    )
    """cosine or poly (per optimizer step, to zero at the last epoch), or plateau (ReduceLROnPlateau on validation
    Dice)."""
    weight_decay: float = flag(
        1e-8,
        "--weight-decay",
        group="optimisation",
        help=f"Weight decay, in [0, {MAX_WEIGHT_DECAY:g}]",
        range=Range(0, MAX_WEIGHT_DECAY),
    )
    """Weight decay of the optimizer (milesial's 1e-8)."""
    momentum: float = flag(
        0.999,
        "--momentum",
        group="optimisation",
        help="RMSprop momentum, in [0, 1)",
        range=Range(0, 1, high_open=True),
    )
    """RMSprop momentum (milesial's 0.999); unused by AdamW."""
    grad_clip: float = flag(
        1.0,
        "--grad-clip",
        group="optimisation",
        help="Max global gradient norm (0 = no clipping)",
        range=Range(0, note=" (0 = off)"),
    )
    """Clip the global gradient norm to this value (0 = off)."""
    grad_accum: int = flag(
        1, "--grad-accum", group="optimisation", help="Micro-batches per optimizer step", range=Range(1)
    )
    """Micro-batches accumulated per optimizer step."""
    max_steps: int = flag(
        0,
        "--max-steps",
        group="optimisation",
        help="Stop after N optimizer steps in total (0 = no limit)",
        range=Range(0, zero="no limit"),
    )
    """Stop after this many optimizer steps in total (0 = no limit); last.pth is written so the run can resume."""
    max_nonfinite_steps: int = flag(
        5,
        "--max-nonfinite-steps",
        group="optimisation",
        help="Stop after N optimizer steps in a row with NaN/inf gradients, each skipped (0 = never stop)",
        range=Range(0, zero="never stop"),
    )
    """Stop with an error after this many optimizer steps in a row with NaN/inf gradients (each is skipped; 0 = never
    stop). Checked at every --log-every step and checkpoint."""
    deterministic: bool = flag(
        False, "--deterministic", group="optimisation", help="Deterministic algorithms (bit-exact resume on CPU)"
    )
    """Use deterministic algorithms (bit-reproducible on CPU; slower on GPU)."""
    class_weights: str | None = flag(
        None,
        "--class-weights",
        group="optimisation",
        metavar="auto|W,W,...",
        help="Cross-entropy class weights: 'auto' (inverse pixel frequency of the training images, clipped at "
        "10x the most frequent class, mean 1) or one number per class (two for --classes 1)",
    )
    """Cross-entropy class weights: 'auto' (inverse frequency, clipped, mean 1) or one number per class ('1,5,5')."""
    warmup_steps: int = flag(
        0,
        "--warmup-steps",
        group="optimisation",
        metavar="N",
        help="Optimizer steps of linear warmup from ~0 to the learning rate, before any --scheduler (0 = none)",
        range=Range(0, zero="none"),
    )
    """Linear warmup of the learning rate over this many optimizer steps before the schedule (0 = none)."""
    ema: float | None = flag(
        None,
        "--ema",
        group="optimisation",
        metavar="DECAY",
        help="Keep an exponential moving average of the weights with this decay in (0, 1), e.g. 0.999; validation, "
        "best.pth and predict use it",
        range=Range(0, 1, low_open=True, high_open=True),
    )
    """Decay of the exponential moving average of the weights (None = off); utils.training.ema."""
    patience: int = flag(
        0,
        "--patience",
        group="optimisation",
        metavar="N",
        help="Stop after N validations without an improvement of validation Dice by more than --min-delta (0 = off)",
        range=Range(0, zero="off"),
    )
    """Early stopping: validations without improvement before the run stops (0 = off); utils.training.early_stop."""
    min_delta: float = flag(
        0.0,
        "--min-delta",
        group="optimisation",
        metavar="D",
        help="With --patience: the validation Dice improvement that counts, in [0, 1)",
        range=Range(0, 1, high_open=True),
    )
    """With --patience: a validation counts as an improvement when its Dice beats the best by more than this."""
    class_names: str | None = flag(
        None,
        "--class-names",
        group="data",
        metavar="NAME,NAME,...",
        help="One name per class, background first (two for --classes 1); predict's legends and evaluate's table "
        "show them",
    )
    """Class names separated by commas ('background,car'), recorded in checkpoints for predict's and evaluate's
    output."""

    # distributed: torchrun needs none of these but --ddp_mode; the others serve manual and legacy launches.
    ddp_mode: bool = flag(
        False, "--ddp_mode", "--ddp-mode", group="distributed", help="DistributedDataParallel training"
    )
    """Train with DistributedDataParallel; needs a launcher (torchrun) or --rank/--world-size."""
    sync_bn: bool = flag(False, "--sync-bn", group="distributed", help="Synchronise BatchNorm across processes")
    """Synchronise BatchNorm statistics across ranks (DDP only)."""
    dist_timeout: float = flag(
        1800.0,
        "--dist-timeout",
        group="distributed",
        help=f"Seconds before a collective waiting for a dead rank fails, in (0, {MAX_DIST_TIMEOUT_S:g}]",
        range=Range(0, MAX_DIST_TIMEOUT_S, low_open=True, note=" seconds"),
    )
    """Seconds a collective may wait for another rank before failing (a dead rank gives an error, not a hang)."""
    rank: int | None = flag(None, "--rank", group="distributed", help="Global rank (manual launch without torchrun)")
    """Global rank for a manual launch (one process per GPU, without torchrun)."""
    world_size: int | None = flag(
        None, "--world-size", group="distributed", help="Number of processes (manual launch)", range=Range(1)
    )
    """World size for a manual launch."""
    dist_url: str | None = flag(None, "--dist-url", group="distributed", help="tcp://HOST:PORT (manual launch)")
    """Rendezvous address for a manual launch, e.g. tcp://10.0.0.1:29500 (else MASTER_ADDR/MASTER_PORT)."""
    local_rank: int | None = flag(
        None,
        "--local-rank",
        "--local_rank",
        group="distributed",
        help="Set by torch.distributed.launch (LOCAL_RANK from the environment wins)",
        range=Range(0),
    )
    """Set by the legacy torch.distributed.launch; LOCAL_RANK from the environment takes precedence."""

    # checkpoints
    exp_name: str = flag("unet", "--exp_name", "--exp-name", group="checkpoints", help="Run name (run folder)")
    """Run name: checkpoints, metrics.jsonl and curves.png go to <checkpoint_dir>/<exp_name>/."""
    checkpoint_dir: str = flag(
        "checkpoints",
        "--checkpoint-dir",
        group="checkpoints",
        help="Parent folder of run folders (<checkpoint-dir>/<exp_name>/)",
    )
    """Parent folder of run folders."""
    load: str | None = flag(
        None, "--load", "-f", group="checkpoints", help="Start from the weights in this file (fresh optimizer)"
    )
    """Weights to start from (fresh optimizer): our checkpoints, milesial state_dicts, 'module.'-prefixed DDP files."""
    start_from: int = flag(
        1,
        "--start_from",
        "--start-from",
        group="checkpoints",
        help="Number of the first epoch (with --load: continue the numbering of the run it came from)",
        range=Range(1, note=" (epochs are numbered from 1)"),
    )
    """Number of the first epoch (continuing a --load run: --start_from 6 --epochs 5 trains epochs 6..10)."""
    resume: str | None = flag(
        None,
        "--resume",
        group="checkpoints",
        const=RESUME_AUTO,
        metavar="auto|PATH",
        help="Resume a run: 'auto' = newest complete checkpoint of the run folder (a new run if there is none), or a "
        "checkpoint path",
    )
    """'auto' (newest complete checkpoint of the run folder; a new run if it has none) or a path; restores all."""
    save_every: int = flag(
        1,
        "--save_every",
        "--save-every",
        group="checkpoints",
        help="Write checkpoint_epoch{N}.pth when epoch N is a multiple of this (0 = never)",
        range=Range(0, zero="never"),
    )
    """Write checkpoint_epoch{N}.pth every this many epochs (0 = never; last.pth and best.pth are always written)."""
    keep_last: int = flag(
        0,
        "--keep-last",
        group="checkpoints",
        help="Keep only the newest K checkpoint_epoch files (0 = all)",
        range=Range(0, zero="keep all"),
    )
    """Keep only the newest K checkpoint_epoch files (0 = keep all)."""
    save_every_minutes: float = flag(
        0.0,
        "--save-every-minutes",
        group="checkpoints",
        help="Also write last.pth when M minutes have passed since the last save (0 = off)",
        range=Range(0, note=" (0 = off)"),
    )
    """Also write last.pth when this many minutes have passed since the last save (0 = off)."""
    keep_best: int = flag(
        0,
        "--keep-best",
        group="checkpoints",
        help="Keep the K best states by validation Dice as best-1.pth .. best-K.pth (0 = best.pth only)",
        range=Range(0, zero="best.pth only"),
    )
    """Keep the K best states by validation Dice as best-1.pth .. best-K.pth (0 = only best.pth)."""
    save_every_steps: int = flag(
        0,
        "--save-every-steps",
        group="checkpoints",
        help="Also write last.pth every N optimizer steps (0 = off)",
        range=Range(0, zero="off"),
    )
    """Also write last.pth every this many optimizer steps (0 = only at epoch ends)."""

    # logging
    val_every: int = flag(1, "--val-every", group="logging", help="Validate every N epochs", range=Range(1))
    """Validate every this many epochs (the last epoch is always validated)."""
    log_every: int = flag(10, "--log-every", group="logging", help="Log every N optimizer steps", range=Range(1))
    """Log loss/lr/throughput every this many optimizer steps (the only host syncs of the training loop)."""
    no_progress: bool = flag(
        False, "--no-progress", group="logging", help="Log lines instead of progress bars (also when not a terminal)"
    )
    """No progress bars: a log line every --log-every steps (automatic when stderr is not a terminal)."""
    val_mode: str = flag(
        "rank0",
        "--val-mode",
        group="distributed",
        help="Validate on global rank 0 (rank0) or split across ranks (sharded, same scores)",
        choices=VAL_MODES,
    )
    """rank0: rank 0 validates while the others wait; sharded: each rank a disjoint part, the sums all-reduced."""
    requeue_signal: str = flag(
        "USR1",
        "--requeue-signal",
        group="distributed",
        help="Under SLURM: the signal (#SBATCH --signal=SIG@SECONDS) that saves, requeues the job and exits",
        choices=REQUEUE_SIGNALS,
    )
    """Under SLURM, this signal saves the full state and requeues the job (scontrol requeue); 'none' = off."""
    wandb: str = flag("disabled", "--wandb", group="logging", help="Weights & Biases mode", choices=WANDB_MODES)
    """Weights & Biases mode; 'disabled' sends nothing and does not import wandb."""
    tensorboard: bool = flag(
        False,
        "--tensorboard",
        group="logging",
        help="Write TensorBoard events (the metrics.jsonl scalars, a few validation images) to <run>/tensorboard/",
    )
    """TensorBoard events in <run>/tensorboard/ from global rank 0 (``utils.training.tensorboard_log``)."""

    # performance
    device: str = flag("auto", "--device", group="performance", help=DEVICE_HELP, value_type=device_flag)
    """auto (cuda:LOCAL_RANK if available, else MPS for one process, else CPU), cuda, cuda:N (one process), mps or
    cpu."""
    amp: bool = flag(
        False, "--amp", group="performance", help="Mixed precision (fp16 + grad scaler on CUDA, bf16 on CPU)"
    )
    """Mixed precision: fp16 with a gradient scaler on CUDA, bf16 elsewhere."""
    precision: str | None = flag(
        None,
        "--precision",
        group="performance",
        help="Autocast precision (default: fp32, or --amp's)",
        choices=PRECISIONS,
    )
    """fp32, bf16 or fp16 autocast; None follows --amp."""
    num_workers: int | None = flag(
        None,
        "--num-workers",
        group="performance",
        help="DataLoader workers per process (default: 0 on CPU; on GPU from the measured cost per item, up to "
        "min(16, cpus per process - 1))",
        range=Range(0),
    )
    """DataLoader worker processes per rank; None picks a default from the device and the CPU count."""
    pixel_cache: str | None = flag(
        None,
        "--pixel-cache",
        group="performance",
        metavar="DIR",
        help="Cache decoded, resized images and masks in DIR (outside the data folders; filled during the first "
        "epoch, or up front with python -m utils.datasets.pixel_cache build-cache)",
    )
    """Folder of decoded, resized pixels filled by the first epoch's loaders and memory-mapped after; None: off."""
    threads: int = flag(
        0,
        "--threads",
        group="performance",
        help="CPU threads per process (0 = cores / processes on this machine)",
        range=Range(0, zero="automatic"),
    )
    """CPU threads per process; 0 = this machine's cores divided by its number of training processes."""
    channels_last: bool = flag(False, "--channels-last", group="performance", help="channels_last memory format")
    """channels_last memory format for the model and inputs."""
    checkpointing: bool = flag(
        False, "--checkpointing", group="performance", help="Activation checkpointing (less memory, more compute)"
    )
    """Activation checkpointing: recompute block activations in the backward pass to save memory."""
    compile: bool = flag(False, "--compile", group="performance", help="torch.compile the model")
    """torch.compile the model."""

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (only str/int/float/bool/None), safe inside a weights_only checkpoint."""
        return dataclasses.asdict(self)


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting, so every error is one line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see python train.py --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="train.py",
        description="Train a UNet for semantic segmentation on one device or with DistributedDataParallel.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        # "--epoch 1" must not pass for --epochs: a typo gets a suggestion instead (parse_config).
        allow_abbrev=False,
    )
    add_config_flag(parser)
    add_flags(parser, TrainConfig, HELP_GROUPS)
    return parser


def parse_config(argv: Sequence[str] | None = None) -> TrainConfig:
    """Parse ``argv`` (default: sys.argv[1:]) into a validated TrainConfig; ``--config FILE`` under the flags."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    namespace, unknown = parser.parse_known_args(argv)
    if unknown:
        raise ConfigError(unknown_arguments_message(parser, unknown))
    config = TrainConfig(**apply_config_file(parser, argv, vars(namespace), TrainConfig))
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
    check_ranges(config)  # each flag's own range, declared with its field
    check_machine_bounds(config)
    check_split_flags(config.split_by, config.group_pattern, config.folds, config.fold)
    if config.class_weights is not None:
        parse_class_weights(config.class_weights, config.classes)
    if config.class_names is not None:
        parse_class_names(config.class_names, config.classes)
    _require(
        bool(config.exp_name) and "/" not in config.exp_name and config.exp_name not in (".", ".."),
        f"--exp_name {config.exp_name!r} must be a plain folder name (no '/')",
    )
    _require(
        not (config.amp and config.precision == "fp32"),
        "--amp asks for mixed precision but --precision fp32 forbids it; drop one of the two",
    )
    _require(
        config.encoder != "unet" or not (config.encoder_weights or config.freeze_encoder_epochs),
        "--encoder-weights and --freeze-encoder-epochs need a ResNet encoder; add --encoder resnet34 (or resnet18, "
        "resnet50, matching the weights file)",
    )
    _require(
        not (config.encoder_weights and config.load),
        "--load sets every weight, the encoder's too, so --encoder-weights would be ignored; pass only one of them",
    )
    _require(
        not (config.encoder != "unet" and config.bilinear),
        f"--bilinear applies to --encoder unet only; drop it with --encoder {config.encoder}",
    )
    _require(
        not (config.encoder != "unet" and config.checkpointing),
        f"--checkpointing is implemented for --encoder unet only; drop it with --encoder {config.encoder}",
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
        _require(0 <= config.rank < config.world_size, f"--rank must be in [0, {config.world_size - 1}]")
    _require(
        config.dist_url is None or config.rank is not None,
        "--dist-url is for manual launches and needs --rank and --world-size (torchrun sets the address itself)",
    )
    _require(
        config.dist_url is None or config.dist_url.startswith(("tcp://", "file://", "env://")),
        f"--dist-url must look like tcp://HOST:PORT, got {config.dist_url!r}",
    )


def check_machine_bounds(config: TrainConfig) -> None:
    """The bounds this machine sets (``utils.machine_bounds``), checked before a run folder or a model exists."""
    check_threads(config.threads)
    if config.num_workers is not None:
        check_workers(config.num_workers, "--num-workers")
    # The photos' channels are not known yet: 3 (the first layer's share of the weights is negligible).
    check_model_fits(3, config.classes, bilinear=config.bilinear, base_channels=config.base_channels)


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
        require_number(weight, "--class-weights", Range(0, low_open=True))
    return weights


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)
