"""Training configuration: one typed dataclass, its command-line parser, and validation done once, up front.

Every flag of milesial/Pytorch-UNet's ``train.py`` and of the documented DDP variant keeps its spelling and short
form (``--epochs/-e``, ``--exp_name``, ``--ddp_mode``, ...); flags with underscores also accept dashes. Errors name
the flag and say what to change; argparse's own errors are turned into the same one-line ``ConfigError``.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from unet import ENCODERS, UNetArgs
from utils.cli import device_flag
from utils.datasets.splits import SplitFlags, check_split_flags
from utils.errors import ConfigError
from utils.flags import MUST_MATCH, NEW_PLAN, FlagParser, build_config, check_class_flags, flag, flag_fields, section
from utils.hardware import PRECISIONS, check_model_fits, check_threads, check_workers
from utils.training.config_file import add_config_flag, apply_config_file

RESUME_AUTO = "auto"

# The upper bounds of the numeric flags that have no natural one (--learning-rate, --weight-decay, --dist-timeout: a
# week) are far above any value that trains (AdamW and RMSprop diverge long before a learning rate of 1) but low
# enough that an absurd value is refused instead of silently destroying the weights. --seed: numpy's seeds are
# 32-bit; --ignore-value: 32-bit grey masks are the widest the data loader reads.


@dataclass
class DataSection(SplitFlags):
    """Where the images are, how they are prepared and split (``utils.training.data``); the split's flags are
    ``SplitFlags``', which the dataset check shares."""

    imgs: str = flag("data/imgs", "--imgs")
    """Folder of input images."""
    masks: str = flag("data/masks", "--masks")
    """Folder of masks (Carvana '<id>_mask' naming is detected)."""
    scale: float = flag(0.5, "--scale", "-s", range="(0, 1]", resume=MUST_MATCH)
    """Downscaling factor of the images, in (0, 1]."""
    augment: bool = flag(False, "--augment", resume=MUST_MATCH)
    """Random flips, scaled crops and colour jitter of training images."""
    ignore_values: list[int] = flag([], "--ignore-value", metavar="V", range="[0, 4294967295]", resume=MUST_MATCH)
    """Void mask value, not a class: left out of the loss and the metrics (repeatable; e.g. 255)."""
    oversample_foreground: float = flag(0.0, "--oversample-foreground", metavar="P", range="[0, 1]", resume=MUST_MATCH)
    """Fraction in [0, 1] of each process's images taken from images with a non-background class."""
    seed: int = flag(0, "--seed", range="[0, 4294967295]", resume=MUST_MATCH)
    """Seed of initialisation, data order and augmentation (0..4294967295)."""
    class_names: str | None = flag(None, "--class-names", metavar="NAME,NAME,...")
    """One name per class, background first (two for --classes 1); predict's legends and evaluate's table show them."""


@dataclass
class ModelSection:
    """The network a new run builds (``utils.training.model``); a resumed run's comes from its checkpoint."""

    classes: int = flag(2, "--classes", "-c", range="[1, inf)", resume=MUST_MATCH)
    """Number of classes (1 = binary, sigmoid)."""
    bilinear: bool = flag(False, "--bilinear", resume=MUST_MATCH)
    """Use bilinear upsampling."""
    base_channels: int = flag(64, "--base-channels", range="[1, inf)", resume=MUST_MATCH)
    """Width of the first UNet block."""
    encoder: str = flag("unet", "--encoder", choices=ENCODERS, resume=MUST_MATCH)
    """unet (milesial's UNet) or a torchvision ResNet encoder under a UNet decoder (inputs normalised with ImageNet
    mean/std inside the model)."""
    encoder_weights: str | None = flag(None, "--encoder-weights", metavar="PATH")
    """Local torchvision state dict for the ResNet encoder (e.g. resnet34-b627a593.pth; fc.* is dropped; never
    downloaded)."""
    freeze_encoder_epochs: int = flag(0, "--freeze-encoder-epochs", range="[0, inf)")
    """Train the decoder alone for the first N epochs (the ResNet encoder's weights stay as loaded)."""
    deep_supervision: bool = flag(False, "--deep-supervision", resume=MUST_MATCH)
    """Also supervise decoder outputs at 1/2 and 1/4 resolution (nnU-Net weights 1, 0.5, 0.25; training only)."""


@dataclass
class OptimisationSection:
    """The loss, optimizer, schedule and step (``utils.training.objective``, ``utils.training.step``), and when the
    run stops."""

    epochs: int = flag(5, "--epochs", "-e", range="[1, inf)", resume=NEW_PLAN)
    """Number of epochs to train (numbered --start_from .. --start_from + epochs - 1)."""
    batch_size: int = flag(1, "--batch-size", "-b", range="[1, inf)")
    """Batch size per process."""
    learning_rate: float = flag(1e-5, "--learning-rate", "-l", range="(0, 1]", resume=MUST_MATCH)
    """Peak learning rate, in (0, 1]."""
    optimizer: str = flag("adamw", "--optimizer", choices=("adamw", "rmsprop"), resume=MUST_MATCH)
    """Optimizer."""
    scheduler: str = flag("cosine", "--scheduler", choices=("cosine", "poly", "plateau"), resume=MUST_MATCH)
    """cosine annealing per step, poly (nnU-Net: (1 - t/T)^0.9 per step), or ReduceLROnPlateau on validation Dice."""
    weight_decay: float = flag(1e-8, "--weight-decay", range="[0, 1]", resume=MUST_MATCH)
    """Weight decay, in [0, 1]."""
    momentum: float = flag(0.999, "--momentum", range="[0, 1)", resume=MUST_MATCH)
    """RMSprop momentum, in [0, 1)."""
    grad_clip: float = flag(1.0, "--grad-clip", range="[0, inf)")
    """Max global gradient norm (0 = no clipping)."""
    grad_accum: int = flag(1, "--grad-accum", range="[1, inf)")
    """Micro-batches per optimizer step."""
    max_steps: int = flag(0, "--max-steps", range="[0, inf)")
    """Stop after N optimizer steps in total (0 = no limit)."""
    max_nonfinite_steps: int = flag(5, "--max-nonfinite-steps", range="[0, inf)")
    """Stop after N optimizer steps in a row with NaN/inf gradients, each skipped (0 = never stop)."""
    deterministic: bool = flag(False, "--deterministic")
    """Deterministic algorithms (bit-exact resume on CPU)."""
    class_weights: str | None = flag(None, "--class-weights", metavar="auto|W,W,...", resume=MUST_MATCH)
    """Cross-entropy class weights: 'auto' (inverse pixel frequency of the training images, clipped at 10x the most
    frequent class, mean 1) or one number per class (two for --classes 1)."""
    warmup_steps: int = flag(0, "--warmup-steps", metavar="N", range="[0, inf)", resume=MUST_MATCH)
    """Optimizer steps of linear warmup from ~0 to the learning rate, before any --scheduler (0 = none)."""
    ema: float | None = flag(None, "--ema", metavar="DECAY", range="(0, 1)", resume=MUST_MATCH)
    """Keep an exponential moving average of the weights with this decay in (0, 1), e.g. 0.999; validation, best.pth and
    predict use it."""
    patience: int = flag(0, "--patience", metavar="N", range="[0, inf)")
    """Stop after N validations without an improvement of validation Dice by more than --min-delta (0 = off)."""
    min_delta: float = flag(0.0, "--min-delta", metavar="D", range="[0, 1)")
    """With --patience: the validation Dice improvement that counts, in [0, 1)."""


@dataclass
class LaunchSection:
    """How the processes join (``utils.launch``): torchrun needs none of these but --ddp_mode; the others serve
    manual and legacy launches."""

    ddp_mode: bool = flag(False, "--ddp_mode", "--ddp-mode")
    """DistributedDataParallel training."""
    sync_bn: bool = flag(False, "--sync-bn")
    """Synchronise BatchNorm across processes."""
    dist_timeout: float = flag(1800.0, "--dist-timeout", range="(0, 604800]")
    """Seconds before a collective waiting for a dead rank fails, in (0, 604800]."""
    rank: int | None = flag(None, "--rank")
    """Global rank (manual launch without torchrun)."""
    world_size: int | None = flag(None, "--world-size", range="[1, inf)")
    """Number of processes (manual launch)."""
    dist_url: str | None = flag(None, "--dist-url")
    """tcp://HOST:PORT (manual launch)."""
    local_rank: int | None = flag(None, "--local-rank", "--local_rank", range="[0, inf)")
    """Set by torch.distributed.launch (LOCAL_RANK from the environment wins)."""
    val_mode: str = flag("rank0", "--val-mode", choices=("rank0", "sharded"))
    """Validate on global rank 0 (rank0) or split across ranks (sharded, same scores)."""
    requeue_signal: str = flag("USR1", "--requeue-signal", choices=("USR1", "USR2", "none"))
    """Under SLURM: the signal (#SBATCH --signal=SIG@SECONDS) that saves, requeues the job and exits."""


@dataclass
class CheckpointSection:
    """The run folder and what is saved in it, when (``utils.checkpoint``)."""

    exp_name: str = flag("unet", "--exp_name", "--exp-name")
    """Run name (run folder)."""
    checkpoint_dir: str = flag("checkpoints", "--checkpoint-dir")
    """Parent folder of run folders (<checkpoint-dir>/<exp_name>/)."""
    load: str | None = flag(None, "--load", "-f", resume=NEW_PLAN)
    """Start from the weights in this file (fresh optimizer)."""
    start_from: int = flag(1, "--start_from", "--start-from", range="[1, inf)", resume=NEW_PLAN)
    """Number of the first epoch (with --load: continue the numbering of the run it came from)."""
    resume: str | None = flag(None, "--resume", nargs="?", const=RESUME_AUTO, metavar="auto|PATH", resume=NEW_PLAN)
    """Resume a run: 'auto' = newest complete checkpoint of the run folder (a new run if there is none), or a checkpoint
    path."""
    save_every: int = flag(1, "--save_every", "--save-every", range="[0, inf)")
    """Write checkpoint_epoch{N}.pth when epoch N is a multiple of this (0 = never)."""
    keep_last: int = flag(0, "--keep-last", range="[0, inf)")
    """Keep only the newest K checkpoint_epoch files (0 = all)."""
    save_every_minutes: float = flag(0.0, "--save-every-minutes", range="[0, inf)")
    """Also write last.pth when M minutes have passed since the last save (0 = off)."""
    keep_best: int = flag(0, "--keep-best", range="[0, inf)")
    """Keep the K best states by validation Dice as best-1.pth .. best-K.pth (0 = best.pth only)."""
    save_every_steps: int = flag(0, "--save-every-steps", range="[0, inf)")
    """Also write last.pth every N optimizer steps (0 = off)."""


@dataclass
class LoggingSection:
    """What the run reports, and how often it validates (``utils.training.run_log``, ``utils.training.loop``)."""

    val_every: int = flag(1, "--val-every", range="[1, inf)")
    """Validate every N epochs."""
    log_every: int = flag(10, "--log-every", range="[1, inf)")
    """Log every N optimizer steps."""
    no_progress: bool = flag(False, "--no-progress")
    """Log lines instead of progress bars (also when not a terminal)."""
    wandb: str = flag("disabled", "--wandb", choices=("online", "offline", "disabled"))
    """Weights & Biases mode."""
    tensorboard: bool = flag(False, "--tensorboard")
    """Write TensorBoard events (the metrics.jsonl scalars, a few validation images) to <run>/tensorboard/."""


@dataclass
class PerformanceSection:
    """Device, precision and speed (none of these changes what is trained)."""

    device: str = flag("auto", "--device", type=device_flag)
    """auto, cpu, cuda, cuda:N or mps (auto: cuda:LOCAL_RANK if there is CUDA, else mps for one process, else cpu)."""
    amp: bool = flag(False, "--amp")
    """Mixed precision (fp16 + grad scaler on CUDA, bf16 on CPU)."""
    precision: str | None = flag(None, "--precision", choices=PRECISIONS)
    """Autocast precision (default: fp32, or --amp's)."""
    num_workers: int | None = flag(None, "--num-workers", range="[0, inf)")
    """DataLoader workers per process (default: 0 on CPU; on GPU from the measured cost per item, up to min(16, cpus per
    process - 1))."""
    pixel_cache: str | None = flag(None, "--pixel-cache", metavar="DIR")
    """Cache decoded, resized images and masks in DIR (outside the data folders; filled during the first epoch, or up
    front with python -m utils.datasets.pixel_cache build-cache)."""
    threads: int = flag(0, "--threads", range="[0, inf)")
    """CPU threads per process (0 = cores / processes on this machine)."""
    channels_last: bool = flag(False, "--channels-last")
    """channels_last memory format."""
    checkpointing: bool = flag(False, "--checkpointing")
    """Activation checkpointing (less memory, more compute)."""
    compile: bool = flag(False, "--compile")
    """torch.compile each block of the model, its compiled code kept in the run folder for a resume (on a CPU slower
    than eager: the run says so, docs/PERFORMANCE.md)."""


@dataclass
class TrainConfig:
    """Everything a training run needs, one section per component; each section is handed whole to the component
    that reads it.

    Each field of a section is also its flag (``utils.flags.flag``), its docstring the help text. Field names are
    unique across the sections, so that checkpoints store the flags as one flat dict (``as_dict``) and config.yaml
    lists them by flag name.
    """

    data: DataSection = section(DataSection, "data")
    model: ModelSection = section(ModelSection, "model")
    optimisation: OptimisationSection = section(OptimisationSection, "optimisation")
    launch: LaunchSection = section(LaunchSection, "distributed")
    checkpoint: CheckpointSection = section(CheckpointSection, "checkpoints")
    logging: LoggingSection = section(LoggingSection, "logging")
    performance: PerformanceSection = section(PerformanceSection, "performance")

    def as_dict(self) -> dict[str, Any]:
        """Flat ``{flag field: value}`` (only str/int/float/bool/None and lists), as checkpoints store it (``args``)."""
        return {dest: value for part in asdict(self).values() for dest, value in part.items()}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainConfig:
        """The config of a flat dict (``as_dict``, config.yaml); a flag missing from it takes its default."""
        return build_config(cls, values)

    def settings_block(self) -> str:
        """The flags whose value is not the flag's default, one per line in field order under each flag's first name
        (``--ema 0.9``; ``python train.py --help`` has the rest): what the run changed, said at its start and in
        config.yaml."""
        values = self.as_dict()
        changed = [
            describe_flag(item.flag.names[0], values[item.dest])
            for item in flag_fields(type(self))
            if values[item.dest] != item.default
        ]
        if not changed:
            return "Settings: all flags at their defaults"
        return "Settings that differ from the defaults:" + "".join(f"\n  {line}" for line in changed)

    def epoch_range(self) -> tuple[int, int]:
        """(first, last) epoch numbers: ``--epochs E --start_from S`` trains S..S+E-1, as the DDP script."""
        first = self.checkpoint.start_from
        return first, first + self.optimisation.epochs - 1


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        TrainConfig,
        prog="train.py",
        description="Train a UNet for semantic segmentation on one device or with DistributedDataParallel.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        # "--epoch 1" must not pass for --epochs: a typo gets a suggestion instead (parse_config).
        allow_abbrev=False,
    )
    add_config_flag(parser)
    return parser


def parse_config(argv: Sequence[str] | None = None) -> TrainConfig:
    """Parse ``argv`` (default: sys.argv[1:]) into a validated TrainConfig; ``--config FILE`` under the flags."""
    config = TrainConfig.from_dict(apply_config_file(build_parser(), argv))
    validate_config(config)
    return config


def validate_config(config: TrainConfig) -> None:
    """Reject impossible values before anything is built; every message names the flag to change."""
    data, model, launch = config.data, config.model, config.launch
    # The bounds this machine sets (utils.hardware), checked before a run folder or a model exists.
    check_threads(config.performance.threads)
    if config.performance.num_workers is not None:
        check_workers(config.performance.num_workers, "--num-workers")
    # For 3 channels: the photos' are not known yet (the first layer's share of the weights is negligible).
    check_model_fits(UNetArgs(3, model.classes, model.bilinear, model.base_channels))
    check_split_flags(data.split_by, data.group_pattern, data.folds, data.fold)
    check_class_flags(data.class_names, config.optimisation.class_weights, model.classes)
    exp_name, load = config.checkpoint.exp_name, config.checkpoint.load
    if not exp_name or "/" in exp_name or exp_name in (".", ".."):
        raise ConfigError(f"--exp_name {exp_name!r} must be a plain folder name (no '/')")
    if config.performance.amp and config.performance.precision == "fp32":
        raise ConfigError("--amp asks for mixed precision but --precision fp32 forbids it; drop one of the two")
    if model.encoder == "unet" and (model.encoder_weights or model.freeze_encoder_epochs):
        raise ConfigError(
            "--encoder-weights and --freeze-encoder-epochs need a ResNet encoder; add --encoder resnet34 (or resnet18, "
            "resnet50, matching the weights file)"
        )
    if model.encoder_weights and load:
        raise ConfigError(
            "--load sets every weight, the encoder's too, so --encoder-weights would be ignored; pass only one of them"
        )
    if model.bilinear and model.encoder != "unet":
        raise ConfigError(f"--bilinear applies to --encoder unet only; drop it with --encoder {model.encoder}")
    if config.performance.checkpointing and model.encoder != "unet":
        raise ConfigError(
            f"--checkpointing is implemented for --encoder unet only; drop it with --encoder {model.encoder}"
        )
    if load and config.checkpoint.resume:
        raise ConfigError("--load starts a new run from weights and --resume continues a run; pass only one of them")
    if (launch.rank is None) != (launch.world_size is None):
        raise ConfigError("--rank and --world-size go together (manual launch: one process per rank)")
    if launch.dist_url is not None and launch.rank is None:
        raise ConfigError(
            "--dist-url is for manual launches and needs --rank and --world-size (torchrun sets the address itself)"
        )


def describe_flag(flag: str, value: Any) -> str:
    """``--seed 0``, ``--ignore-value 0 --ignore-value 255``, ``--augment``; an unset flag as ``no --class-weights``:
    a flag's value as the command line would give it."""
    values = list(value) if isinstance(value, list | tuple) else [value]
    if value is None or value is False or not values:
        return f"no {flag}"
    return flag if value is True else " ".join(f"{flag} {one}" for one in values)
