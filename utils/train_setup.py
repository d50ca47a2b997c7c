"""Building a training run: data, model, optimizer, schedule, restored state, DDP wrapping, loaders.

Every rank builds its own copy (per the PyTorch DDP tutorial: each rank loads the checkpoint before wrapping the model
in DDP). Decisions that depend on the run folder (which checkpoint to resume, whether the folder is taken) are made
by global rank 0, the folder's only writer, and broadcast; a user error on any rank stops every rank with its message
instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import logging
import math
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from unet import UNet

from .checkpoint import (
    KEY_ARGS,
    KEY_MASK_VALUES,
    KEY_MODEL,
    KEY_MODEL_ARGS,
    KEY_OPTIMIZER,
    KEY_RNG,
    KEY_SCALER,
    KEY_SCHEDULER,
    KEY_WORLD_SIZE,
    infer_model_args,
    load_state_dict_checked,
    read_model_weights,
    remove_partial_files,
)
from .config import RESUME_AUTO, TrainConfig, resolve_precision
from .distributed import DistributedContext, agree_on_errors, available_cpus, decide_on_main, threads_per_process
from .errors import CheckpointError, ConfigError
from .interrupts import InterruptFlag
from .optim import build_optimizer, build_scheduler
from .run_logging import RunReporter
from .sharding import ResumableDistributedSampler, batches_per_epoch, images_consumed
from .sync_batchnorm import convert_sync_batchnorm
from .train_data import TrainData, build_data, build_train_loader, build_val_loader, default_num_workers
from .train_state import (
    TrainPosition,
    find_resume_checkpoint,
    load_resume_checkpoint,
    position_of,
    restore_rng_state,
    resume_candidates,
)
from .trainer import Trainer, TrainParts

logger = logging.getLogger(__name__)

# Flags whose change makes a checkpoint's optimizer or schedule state meaningless.
_STATE_SHAPING_FLAGS = {"optimizer": "--optimizer", "scheduler": "--scheduler"}
_MODEL_FLAGS = {
    "n_classes": "--classes",
    "bilinear": "--bilinear",
    "base_channels": "--base-channels",
}


def run_folder(config: TrainConfig) -> Path:
    return Path(config.checkpoint_dir) / config.exp_name


def build_trainer(config: TrainConfig, ctx: DistributedContext, interrupts: InterruptFlag) -> Trainer:
    run_dir = run_folder(config)
    # Rank 0 reads the checkpoint it chooses; keeping it saves reading a large file twice.
    preloaded: dict[str, dict[str, Any]] = {}
    resume_path = decide_on_main(ctx, lambda: _choose_resume_path(config, run_dir, preloaded))
    configure_reproducibility(config)
    parts = agree_on_errors(ctx, lambda: build_parts(config, ctx, resume_path, preloaded.get(resume_path or "")))
    reporter = agree_on_errors(ctx, lambda: _open_reporter(config, ctx, run_dir))
    return Trainer(config, ctx, parts, run_dir=run_dir, reporter=reporter, interrupts=interrupts)


def _open_reporter(config: TrainConfig, ctx: DistributedContext, run_dir: Path) -> RunReporter:
    try:
        return RunReporter(
            run_dir, enabled=ctx.is_main, wandb_mode=config.wandb, run_name=config.exp_name, config=config.as_dict()
        )
    except OSError as error:
        raise ConfigError(
            f"cannot write to the run folder {run_dir}: {error.strerror or error}; choose a writable --checkpoint-dir"
        ) from error


def configure_reproducibility(config: TrainConfig) -> None:
    """Same seed on every rank (identical initial weights); deterministic kernels if asked, else the fastest."""
    random.seed(config.seed)
    np.random.seed(config.seed)
    torch.manual_seed(config.seed)
    if config.deterministic:
        # cuBLAS needs this before its first use to be deterministic; harmless elsewhere.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = config.deterministic
    torch.backends.cudnn.benchmark = not config.deterministic


def _choose_resume_path(config: TrainConfig, run_dir: Path, preloaded: dict[str, dict[str, Any]]) -> str | None:
    """Rank 0's choice of checkpoint to resume (None for a new run); refuses to start a new run over an old one."""
    _check_run_folder(config, run_dir)
    # Nothing writes to the folder yet: a temporary file there is what a killed write left behind.
    for path in remove_partial_files(run_dir):
        logger.info("Removed %s, left behind by a checkpoint write that was interrupted", path)
    if config.resume is None:
        existing = resume_candidates(run_dir)
        if existing:
            raise ConfigError(
                f"run folder {run_dir} already holds checkpoints ({', '.join(p.name for p in existing[:3])}) from an "
                f"earlier run; continue it with --resume auto, or choose another --exp_name (or delete the folder)"
            )
        return None
    if config.resume == RESUME_AUTO:
        found = find_resume_checkpoint(run_dir)
        if found is None:
            logger.info("--resume auto: no checkpoint in %s yet, starting a new run", run_dir)
            return None
        path, payload = found
        preloaded[str(path)] = payload
        return str(path)
    resume_path = Path(config.resume)
    if not resume_path.is_file():
        raise CheckpointError(f"--resume {config.resume}: no such file; pass a checkpoint path or --resume auto")
    existing = resume_candidates(run_dir)
    if existing and resume_path.resolve().parent != run_dir.resolve():
        raise ConfigError(
            f"--resume {config.resume} would continue in run folder {run_dir}, which holds checkpoints of another run "
            f"({', '.join(p.name for p in existing[:3])}); choose another --exp_name"
        )
    return config.resume


def _check_run_folder(config: TrainConfig, run_dir: Path) -> None:
    """A run folder that cannot exist (a file in its way) stops the run now rather than at its first save."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(
            f"the run folder {run_dir} cannot be created: {existing} is a file, not a folder; choose another "
            f"--checkpoint-dir (or --exp_name)"
        )


def build_parts(
    config: TrainConfig, ctx: DistributedContext, resume_path: str | None, payload: dict[str, Any] | None = None
) -> TrainParts:
    """Everything the loop needs, restored from ``resume_path`` (whose contents may be passed in as ``payload``)."""
    device = ctx.device
    if resume_path and payload is None:
        payload = load_resume_checkpoint(Path(resume_path))
    if payload is not None:
        logger.info("Resuming from %s", resume_path)
        _check_resume_flags(config, payload, resume_path)
    data = build_data(config, world_size=ctx.world_size)
    precision = resolve_precision(config, device.type)
    if precision == "bf16" and device.type == "cpu" and not _cpu_has_native_bf16():
        logger.warning(
            "bf16 on this CPU is emulated (no AVX-512 BF16/AMX) and trains about 5x slower than fp32 "
            "(docs/PERFORMANCE.md); use --precision fp32 here"
        )
    model_args = {
        "n_channels": data.n_channels,
        "n_classes": config.classes,
        "bilinear": config.bilinear,
        "base_channels": config.base_channels,
    }
    model = UNet(**model_args)
    if payload is not None:
        _load_weights(model, payload[KEY_MODEL], payload.get(KEY_MODEL_ARGS), model_args, resume_path, "--resume")
        _warn_mask_values(payload.get(KEY_MASK_VALUES), data.mask_values, resume_path)
    elif config.load:
        loaded = read_model_weights(config.load)
        _load_weights(model, loaded.state_dict, loaded.model_args, model_args, config.load, "--load")
        _warn_mask_values(loaded.mask_values, data.mask_values, config.load)
        logger.info("Model weights loaded from %s", config.load)
    if config.checkpointing:
        model.use_checkpointing()
    if config.sync_bn:
        if ctx.is_distributed:
            model = convert_sync_batchnorm(model, device)
        else:
            logger.warning("--sync-bn has no effect with a single process")
    memory_format = torch.channels_last if config.channels_last else torch.preserve_format
    model.to(device=device, memory_format=memory_format)

    optimizer = build_optimizer(config, model.parameters())
    batches = batches_per_epoch(len(data.train_set), world_size=ctx.world_size, batch_size=config.batch_size)
    total_steps = (config.epochs - config.start_from + 1) * math.ceil(batches / config.grad_accum)
    scheduler = build_scheduler(config, optimizer, total_steps)
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None

    position = TrainPosition(epoch=config.start_from - 1)
    resume_images = 0
    if payload is not None:
        optimizer.load_state_dict(payload[KEY_OPTIMIZER])
        scheduler.load_state_dict(payload[KEY_SCHEDULER])
        if scaler is not None and payload.get(KEY_SCALER):
            scaler.load_state_dict(payload[KEY_SCALER])
        if KEY_RNG in payload:
            restore_rng_state(payload[KEY_RNG])
        position = position_of(payload)
        resume_images = _resumed_images_in_epoch(config, ctx, payload, position)
        logger.info(
            "Resuming at epoch %d, step %d (%d batches of the epoch done)",
            position.epoch + 1,
            position.global_step,
            position.step_in_epoch,
        )

    ddp_model = None
    train_model: torch.nn.Module = model
    if ctx.is_distributed:
        device_ids = [device.index] if device.type == "cuda" else None
        ddp_model = DistributedDataParallel(model, device_ids=device_ids)
        train_model = ddp_model
    if config.compile:
        train_model = torch.compile(train_model)

    sampler = ResumableDistributedSampler(
        len(data.train_set), rank=ctx.rank, world_size=ctx.world_size, seed=config.seed, shuffle=True
    )
    num_workers = config.num_workers
    if num_workers is None:
        num_workers = default_num_workers(device.type, threads_per_process(available_cpus(), ctx.local_world_size))
    pin = device.type == "cuda"
    train_loader = build_train_loader(data.train_set, sampler, config, num_workers=num_workers, pin=pin)
    val_loader = build_val_loader(data.val_set, config, num_workers=num_workers, pin=pin) if ctx.is_main else None
    _log_run_summary(config, ctx, data, precision, num_workers)
    return TrainParts(
        raw_model=model,
        model=train_model,
        ddp_model=ddp_model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        precision=precision,
        data=data,
        sampler=sampler,
        train_loader=train_loader,
        val_loader=val_loader,
        model_args=model_args,
        position=position,
        resume_images_in_epoch=resume_images,
    )


def _check_resume_flags(config: TrainConfig, payload: dict[str, Any], path: str) -> None:
    saved_args = payload.get(KEY_ARGS) or {}
    for key, flag in _STATE_SHAPING_FLAGS.items():
        saved = saved_args.get(key)
        if saved is not None and saved != getattr(config, key):
            raise ConfigError(
                f"{path} was trained with {flag} {saved} but this run asks for {flag} {getattr(config, key)}; resume "
                f"with {flag} {saved}, or start a new run from its weights with --load"
            )
    if config.start_from != 1:
        logger.warning("--start_from is ignored with --resume: the checkpoint says where the run stands")


def _load_weights(
    model: UNet,
    state_dict: dict[str, torch.Tensor],
    stored_args: dict[str, Any] | None,
    wanted_args: dict[str, Any],
    path: str,
    flag: str,
) -> None:
    """Load ``state_dict`` after checking it was made for the model these flags and images describe."""
    stored = stored_args or infer_model_args(state_dict)
    if stored.get("n_channels") != wanted_args["n_channels"]:
        raise CheckpointError(
            f"{flag} {path} expects {stored.get('n_channels')}-channel images but the images in --imgs have "
            f"{wanted_args['n_channels']} channels; use a checkpoint trained on such images"
        )
    for key, model_flag in _MODEL_FLAGS.items():
        if key in stored and stored[key] != wanted_args[key]:
            shown = (
                f"{model_flag} {stored[key]}"
                if key != "bilinear"
                else ("--bilinear" if stored[key] else "no --bilinear")
            )
            raise CheckpointError(
                f"{flag} {path} was trained with {key}={stored[key]} but this run has {key}={wanted_args[key]}; "
                f"pass {shown} or use a matching checkpoint"
            )
    load_state_dict_checked(model, state_dict, path)


def _warn_mask_values(stored: list | None, current: list, path: str) -> None:
    if stored is not None and list(stored) != list(current):
        logger.warning(
            "%s was trained with mask values %s but the masks now have %s: class indices may mean other things",
            path,
            stored,
            current,
        )


def _resumed_images_in_epoch(
    config: TrainConfig, ctx: DistributedContext, payload: dict[str, Any], position: TrainPosition
) -> int:
    """Global images of the resumed epoch already trained, converted from the saving run's batches.

    The position is stored as batches of the saving run; times its batch size and world size it is a count of images
    of the epoch's order (``utils.sharding``), which this run skips whatever its own world size.
    """
    saved_args = payload.get(KEY_ARGS) or {}
    saved_world = int(payload.get(KEY_WORLD_SIZE) or 1)
    saved_batch = int(saved_args.get("batch_size", config.batch_size))
    saved_accum = int(saved_args.get("grad_accum", config.grad_accum))
    images = images_consumed(position.step_in_epoch, batch_size=saved_batch, world_size=saved_world)
    if (saved_world, saved_batch, saved_accum) != (ctx.world_size, config.batch_size, config.grad_accum):
        logger.warning(
            "the effective batch size changes from %d (%d process(es) x --batch-size %d x --grad-accum %d) in the "
            "checkpoint to %d (%d x %d x %d) in this run; consider scaling --learning-rate. The data continues from "
            "the same image (%d of this epoch done), but the steps are not bit-identical to an uninterrupted run",
            saved_world * saved_batch * saved_accum,
            saved_world,
            saved_batch,
            saved_accum,
            ctx.world_size * config.batch_size * config.grad_accum,
            ctx.world_size,
            config.batch_size,
            config.grad_accum,
            images,
        )
    return images


def _log_run_summary(
    config: TrainConfig, ctx: DistributedContext, data: TrainData, precision: str, num_workers: int
) -> None:
    logger.info(
        "Starting training: epochs %d..%d, batch size %d per process x %d process(es) x %d accumulation = %d, "
        "learning rate %g, %d training / %d validation images, scale %g, precision %s, device %s, "
        "%d CPU threads and %d loader workers per process, run folder %s",
        config.start_from,
        config.epochs,
        config.batch_size,
        ctx.world_size,
        config.grad_accum,
        config.batch_size * ctx.world_size * config.grad_accum,
        config.learning_rate,
        len(data.train_set),
        len(data.val_set),
        config.scale,
        precision,
        ctx.device,
        torch.get_num_threads(),
        num_workers,
        run_folder(config),
    )


def _cpu_has_native_bf16() -> bool:
    """Whether oneDNN has bf16 instructions on this CPU; assume yes when PyTorch cannot tell."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else True
    except RuntimeError:
        return True
