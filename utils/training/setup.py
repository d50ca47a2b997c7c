"""Building a training run from the parsed flags: the one place that reads ``TrainConfig``.

Each component gets its own small config (``DataConfig``, ``OptimizerConfig``, ``StepConfig``, ``LoopConfig``) or
plain values built here, and the batch arithmetic is computed once (``BatchPlan``) and handed down.

Every rank builds its own copy (per the PyTorch DDP tutorial: each rank loads the checkpoint before wrapping the model
in DDP). Decisions that depend on the run folder (which checkpoint to resume, whether the folder is taken) are made
by global rank 0, the folder's only writer, and broadcast; a user error on any rank stops every rank with its message
instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from unet import UNet
from utils.checkpoint import (
    KEY_ARGS,
    KEY_DATASET,
    KEY_MASK_VALUES,
    KEY_MODEL,
    KEY_MODEL_ARGS,
    KEY_OPTIMIZER,
    KEY_RNG,
    KEY_SCALER,
    KEY_SCHEDULER,
    KEY_WORLD_SIZE,
    LoadedWeights,
    read_model_weights,
)
from utils.distributed import DistributedContext, LaunchPlan, agree_on_errors, decide_on_main, plan_launch, setup
from utils.errors import CheckpointError, ConfigError
from utils.hardware import available_cpus, resolve_precision, threads_per_process, warn_if_emulated
from utils.model_spec import check_expected, load_weights_into, spec_of
from utils.training.config import RESUME_AUTO, TrainConfig, parse_class_weights
from utils.training.data import (
    DataConfig,
    TrainData,
    build_data,
    build_train_loader,
    build_val_loader,
    default_num_workers,
)
from utils.training.interrupts import InterruptFlag
from utils.training.loop import LoopConfig, Trainer, TrainParts
from utils.training.objective import OptimizerConfig, auto_class_weights, build_optimizer, build_scheduler
from utils.training.reporting import RunReporter
from utils.training.run_folder import RunFolder, RunSeries
from utils.training.sampler import BatchPlan, ResumableDistributedSampler, images_consumed
from utils.training.state import (
    TrainPosition,
    dataset_record,
    load_resume_checkpoint,
    position_of,
    restore_rng_state,
)
from utils.training.step import StepConfig, TrainStep
from utils.training.sync_batchnorm import convert_sync_batchnorm

logger = logging.getLogger(__name__)

# Flags a resume must repeat: the optimizer restores its own learning rate, weight decay and momentum from the
# checkpoint (a new value would be logged but not used), and the data flags decide which images are trained and
# which validate (a larger --validation would move trained images into the validation set). Every other flag takes
# its new value; the model's own arguments are checked by utils.model_spec. README, "What survives a crash".
_MUST_MATCH_FLAGS = {
    "optimizer": "--optimizer",
    "scheduler": "--scheduler",
    "learning_rate": "--learning-rate",
    "weight_decay": "--weight-decay",
    "momentum": "--momentum",
    "scale": "--scale",
    "validation": "--validation",
    "seed": "--seed",
    "ignore_values": "--ignore-value",
    "oversample_foreground": "--oversample-foreground",
    "class_weights": "--class-weights",
}


def launch_plan(config: TrainConfig, argv: list[str]) -> LaunchPlan:
    """How this process takes part in the run: from the launcher's environment and the distributed flags."""
    return plan_launch(
        ddp_mode=config.ddp_mode,
        rank=config.rank,
        world_size=config.world_size,
        dist_url=config.dist_url,
        local_rank=config.local_rank,
        argv=argv,
    )


def join(config: TrainConfig, plan: LaunchPlan) -> DistributedContext:
    """Pick the device, size the thread pool and join the process group, as the flags say."""
    return setup(plan, device_request=config.device, timeout_s=config.dist_timeout, threads=config.threads)


def build_trainer(config: TrainConfig, ctx: DistributedContext, interrupts: InterruptFlag) -> Trainer:
    # Rank 0 chooses (and locks) the run folder and the checkpoint to resume; every rank and node gets its choice.
    # Rank 0 has read the checkpoint it chose; keeping it saves reading a large file twice.
    preloaded: dict[str, dict[str, Any]] = {}
    series = RunSeries(config.checkpoint_dir, config.exp_name)
    chosen: list[RunFolder] = []
    folder_path, resume_path = decide_on_main(
        ctx, lambda: _choose_run(config.resume, series, ctx.restart_count, preloaded, chosen)
    )
    run_folder = chosen[0] if chosen else RunFolder(folder_path)
    try:
        configure_reproducibility(config.seed, deterministic=config.deterministic)
        parts = agree_on_errors(
            ctx, lambda: build_parts(config, ctx, resume_path, preloaded.get(resume_path or ""), run_folder=run_folder)
        )
        reporter = agree_on_errors(ctx, lambda: _open_reporter(config, ctx, run_folder))
    except BaseException:
        run_folder.unlock()
        raise
    loop_settings = loop_config(config, last_epoch=epoch_range(parts.run_args)[1])
    return Trainer(loop_settings, ctx, parts, run_folder=run_folder, reporter=reporter, interrupts=interrupts)


# ------------------------------------------------------------------------------------------ component configs


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


def optimizer_config(config: TrainConfig) -> OptimizerConfig:
    return OptimizerConfig(
        name=config.optimizer,
        learning_rate=config.learning_rate,
        weight_decay=config.weight_decay,
        momentum=config.momentum,
        scheduler=config.scheduler,
    )


def step_config(config: TrainConfig, precision: str, class_weights: tuple[float, ...] | None = None) -> StepConfig:
    return StepConfig(
        n_classes=config.classes,
        precision=precision,
        grad_clip=config.grad_clip,
        channels_last=config.channels_last,
        class_weights=class_weights,
    )


def class_weights_of(config: TrainConfig, data: TrainData) -> tuple[float, ...] | None:
    """--class-weights as numbers: given, or 'auto' from the training images' class pixel counts (None: off)."""
    if config.class_weights is None:
        return None
    weights = parse_class_weights(config.class_weights, config.classes)
    if weights is None:
        counts = list(data.train_class_pixels) + [0] * (max(config.classes, 2) - len(data.train_class_pixels))
        if sum(counts) == 0:
            raise ConfigError("--class-weights auto found no labelled pixels in the training masks; give the weights")
        weights = tuple(auto_class_weights(counts))
        logger.info(
            "--class-weights auto: class pixel counts %s give weights %s", counts, [round(w, 4) for w in weights]
        )
    return weights


def loop_config(config: TrainConfig, *, last_epoch: int) -> LoopConfig:
    """``last_epoch``: from the run's epoch plan (``epoch_range``), which a resumed run takes from its checkpoint."""
    return LoopConfig(
        last_epoch=last_epoch,
        n_classes=config.classes,
        val_every=config.val_every,
        save_every=config.save_every,
        keep_last=config.keep_last,
        save_every_steps=config.save_every_steps,
        log_every=config.log_every,
        max_steps=config.max_steps,
        max_nonfinite_steps=config.max_nonfinite_steps,
        save_every_minutes=config.save_every_minutes,
        keep_best=config.keep_best,
        plateau_scheduler=config.scheduler == "plateau",
    )


# ------------------------------------------------------------------------------------------------ epoch plan


def epoch_range(run_args: dict[str, Any]) -> tuple[int, int]:
    """(first, last) epoch numbers of a run: ``--epochs E --start_from S`` trains S..S+E-1, as the DDP script."""
    first = int(run_args["start_from"])
    return first, first + int(run_args["epochs"]) - 1


def planned_run_args(config: TrainConfig, payload: dict[str, Any] | None) -> dict[str, Any]:
    """The run's flags as stored in its checkpoints; a resumed run keeps the epoch plan its checkpoint records.

    The plan is made once, when the run starts: resuming continues it whatever --epochs/--start_from say now (to
    train on with another plan, start a new run from the weights with --load and --start_from).
    """
    run_args = config.as_dict()
    saved = (payload or {}).get(KEY_ARGS) or {}
    if "epochs" in saved and "start_from" in saved:
        plan = {"epochs": int(saved["epochs"]), "start_from": int(saved["start_from"])}
        if (config.epochs, config.start_from) != (plan["epochs"], plan["start_from"]):
            first, last = epoch_range(plan)
            logger.warning(
                "--resume continues the run's plan, epochs %d..%d (--start_from %d --epochs %d); this command's "
                "--start_from %d --epochs %d are ignored",
                first,
                last,
                plan["start_from"],
                plan["epochs"],
                config.start_from,
                config.epochs,
            )
        run_args.update(plan)
    return run_args


# ------------------------------------------------------------------------------------------------ the run


def _open_reporter(config: TrainConfig, ctx: DistributedContext, run_folder: RunFolder) -> RunReporter:
    try:
        return RunReporter(
            run_folder, enabled=ctx.is_main, wandb_mode=config.wandb, run_name=config.exp_name, config=config.as_dict()
        )
    except OSError as error:
        raise ConfigError(
            f"cannot write to the run folder {run_folder}: {error.strerror or error}; choose a writable "
            f"--checkpoint-dir"
        ) from error


def configure_reproducibility(seed: int, *, deterministic: bool) -> None:
    """Same seed on every rank (identical initial weights); deterministic kernels if asked, else the fastest."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS needs this before its first use to be deterministic; harmless elsewhere.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic


def _choose_run(
    resume: str | None,
    series: RunSeries,
    restart_count: int,
    preloaded: dict[str, dict[str, Any]],
    chosen: list[RunFolder],
) -> tuple[str, str | None]:
    """Rank 0's run folder (locked) and checkpoint to resume (None for a new run), as plain strings to broadcast.

    No write may land on a newer state or on another run, so:

    * no ``--resume``: a new folder of the series (``RunSeries.start_new``);
    * ``--resume auto``, and a torchrun restart without ``--resume``: the newest folder, from its newest checkpoint;
    * ``--resume PATH``: the folder PATH lies in when PATH holds that folder's newest state
      (``RunFolder.can_continue_from``); else (an older state of its folder, or a file from outside the series) a new
      folder, as a rerun takes;
    * a torchrun restart of ``--resume PATH``: the folder the first attempt took, from its newest checkpoint (PATH
      again would throw away that attempt's progress), and from PATH only while that folder holds none.

    A locked folder is never continued or written.
    """
    if resume is None and restart_count == 0:
        return _took(series.start_new(), chosen), None
    if resume is None or resume == RESUME_AUTO:
        folder = series.continue_newest()
        folder_path = _took(folder, chosen)
        found = folder.find_resume_checkpoint()
        if found is None:
            logger.info("--resume auto: no checkpoint in %s yet, starting a new run", folder)
            return folder_path, None
        path, payload = found
        preloaded[str(path)] = payload
        return folder_path, str(path)
    if restart_count > 0:
        return _restart_from_path(resume, series, restart_count, preloaded, chosen)
    return _resume_from_path(resume, series, preloaded, chosen)


def _resume_from_path(
    resume: str, series: RunSeries, preloaded: dict[str, dict[str, Any]], chosen: list[RunFolder]
) -> tuple[str, str]:
    resume_path = Path(resume)
    payload = preloaded[resume] = _read_resume_file(resume)
    own = series.contains(resume_path)
    if own is None:  # a file from outside the series: nothing of the series to continue
        return _took(series.start_new(), chosen), resume
    if own.take_to_continue(resume_path, payload):
        return _took(own, chosen), resume
    reason = f"--resume {resume} is not the newest state of {own} (continuing there would overwrite newer checkpoints)"
    return _took(series.start_new(reason), chosen), resume


def _restart_from_path(
    resume: str,
    series: RunSeries,
    restart_count: int,
    preloaded: dict[str, dict[str, Any]],
    chosen: list[RunFolder],
) -> tuple[str, str]:
    # The first attempt took either the folder PATH lies in or the series' newest (a new one, or an empty one).
    candidates = [folder for folder in (series.contains(Path(resume)), series.newest()) if folder is not None]
    first = series.taken_last(candidates)
    if first is None:  # neither was ever locked: the first attempt failed before it chose, so choose as it would have
        return _resume_from_path(resume, series, preloaded, chosen)
    first.lock()
    folder_path = _took(first, chosen)
    found = first.find_resume_checkpoint()
    if found is None:
        logger.info("torchrun restart %d: no checkpoint in %s yet, resuming --resume %s", restart_count, first, resume)
        preloaded[resume] = _read_resume_file(resume)
        return folder_path, resume
    path, payload = found
    preloaded[str(path)] = payload
    logger.info(
        "torchrun restart %d continues %s, the folder its first attempt took, from its newest checkpoint %s",
        restart_count,
        first,
        path,
    )
    return folder_path, str(path)


def _read_resume_file(resume: str) -> dict[str, Any]:
    path = Path(resume)
    if not path.is_file():
        raise CheckpointError(f"--resume {resume}: no such file; pass a checkpoint path or --resume auto")
    return load_resume_checkpoint(path)


def _took(folder: RunFolder, chosen: list[RunFolder]) -> str:
    """Record the folder this process has locked and clear what killed writes left there; returns its path."""
    chosen.append(folder)
    _remove_partial_files(folder)
    return str(folder.path)


def _remove_partial_files(folder: RunFolder) -> None:
    # Under the lock nothing else writes to the folder: a temporary file there is what a killed write left behind.
    for path in folder.remove_partial_files():
        logger.info("Removed %s, left behind by a checkpoint write that was interrupted", path)


def build_parts(
    config: TrainConfig,
    ctx: DistributedContext,
    resume_path: str | None,
    payload: dict[str, Any] | None = None,
    *,
    run_folder: RunFolder | None = None,
) -> TrainParts:
    """Everything the loop needs, restored from ``resume_path`` (whose contents may be passed in as ``payload``)."""
    device = ctx.device
    if resume_path and payload is None:
        payload = load_resume_checkpoint(Path(resume_path))
    if payload is not None:
        logger.info("Resuming from %s", resume_path)
        _check_resume_flags(config, payload, resume_path)
    data = build_data(data_config(config), world_size=ctx.world_size)
    precision = resolve_precision(config.precision, config.amp, device.type)
    warn_if_emulated(device, precision)
    model_args = {
        "n_channels": data.n_channels,
        "n_classes": config.classes,
        "bilinear": config.bilinear,
        "base_channels": config.base_channels,
    }
    model = UNet(**model_args)
    if payload is not None:
        stored = LoadedWeights(payload[KEY_MODEL], payload.get(KEY_MODEL_ARGS), payload.get(KEY_MASK_VALUES), payload)
        _check_same_dataset(payload, data, resume_path)
        _load_weights(model, stored, model_args, resume_path, "--resume")
        _warn_mask_values(payload.get(KEY_MASK_VALUES), data.mask_values, resume_path)
    elif config.load:
        loaded = read_model_weights(config.load)
        _load_weights(model, loaded, model_args, config.load, "--load")
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

    plan = BatchPlan(
        n_train=len(data.train_set),
        batch_size=config.batch_size,
        world_size=ctx.world_size,
        grad_accum=config.grad_accum,
    )
    run_args = planned_run_args(config, payload)
    optimizer_settings = optimizer_config(config)
    optimizer = build_optimizer(optimizer_settings, model.parameters())
    # Planned for the run's epochs; a resumed run's scheduler state brings back the plan it was made with.
    scheduler = build_scheduler(optimizer_settings, optimizer, plan.total_steps(int(run_args["epochs"])))
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
        resume_images = _resumed_images_in_epoch(plan, payload, position)
        logger.info(
            "Resuming at epoch %d, step %d (%d batches of the epoch done)",
            position.epoch + 1,
            position.global_step,
            position.step_in_epoch,
        )

    train_model: torch.nn.Module = model
    if ctx.is_distributed:
        device_ids = [device.index] if device.type == "cuda" else None
        train_model = DistributedDataParallel(model, device_ids=device_ids)
    if config.compile:
        train_model = torch.compile(train_model)
    step = TrainStep(
        step_config(config, precision, class_weights_of(config, data)),
        model=train_model,
        raw_model=model,
        optimizer=optimizer,
        scheduler=None if config.scheduler == "plateau" else scheduler,
        scaler=scaler,
        device=device,
    )

    sampler = ResumableDistributedSampler(
        len(data.train_set),
        rank=ctx.rank,
        world_size=ctx.world_size,
        seed=config.seed,
        shuffle=True,
        foreground=data.train_foreground,
        oversample_foreground=config.oversample_foreground,
    )
    if config.oversample_foreground and not data.train_foreground:
        raise ConfigError(
            f"--oversample-foreground {config.oversample_foreground:g}: none of the {len(data.train_set)} training "
            f"images contains a non-background class; drop the flag or check --masks"
        )
    num_workers = config.num_workers
    if num_workers is None:
        num_workers = default_num_workers(
            device.type,
            threads_per_process(available_cpus(), ctx.local_world_size),
            data.item_seconds,
            data.item_pixels,
        )
    pin = device.type == "cuda"
    loader_settings = data_config(config)
    train_loader = build_train_loader(data.train_set, sampler, loader_settings, num_workers=num_workers, pin=pin)
    val_loader = (
        build_val_loader(data.val_set, loader_settings, num_workers=num_workers, pin=pin) if ctx.is_main else None
    )
    _log_run_summary(config, ctx, data, plan, precision, num_workers, epoch_range(run_args), run_folder)
    return TrainParts(
        raw_model=model,
        step=step,
        scheduler=scheduler,
        precision=precision,
        data=data,
        sampler=sampler,
        train_loader=train_loader,
        val_loader=val_loader,
        batch_plan=plan,
        model_args=model_args,
        run_args=run_args,
        position=position,
        resume_images_in_epoch=resume_images,
    )


def _check_resume_flags(config: TrainConfig, payload: dict[str, Any], path: str) -> None:
    saved_args = payload.get(KEY_ARGS) or {}
    for key, flag in _MUST_MATCH_FLAGS.items():
        saved = saved_args.get(key)
        if saved is not None and saved != getattr(config, key):
            raise ConfigError(
                f"{path} was trained with {flag} {saved} but this run asks for {flag} {getattr(config, key)}; resume "
                f"with {flag} {saved}, or start a new run from its weights with --load {path}"
            )


def _check_same_dataset(payload: dict[str, Any], data: TrainData, path: str) -> None:
    """Refuse to continue a run on other files: the split and the epoch order are defined on the file list."""
    saved = payload.get(KEY_DATASET)
    if not isinstance(saved, dict):
        return  # written before datasets were recorded
    current = dataset_record(data.train_dataset.ids)
    if saved.get("fingerprint") != current["fingerprint"]:
        raise ConfigError(
            f"{path} was trained on another dataset ({saved.get('images')} images, now {current['images']} in "
            f"--imgs/--masks, or the same number with other file names); resume with the same --imgs and --masks, "
            f"or start a new run from its weights with --load {path}"
        )


def _load_weights(model: UNet, loaded: LoadedWeights, wanted_args: dict[str, Any], path: str, flag: str) -> None:
    """Load ``loaded`` after checking it was made for the model these flags and images describe."""
    spec = spec_of(loaded, path)
    check_expected(spec, wanted_args, path, source=flag, images_from="--imgs")
    load_weights_into(model, loaded, path)


def _warn_mask_values(stored: list | None, current: list, path: str) -> None:
    if stored is not None and list(stored) != list(current):
        logger.warning(
            "%s was trained with mask values %s but the masks now have %s: class indices may mean other things",
            path,
            stored,
            current,
        )


def _resumed_images_in_epoch(plan: BatchPlan, payload: dict[str, Any], position: TrainPosition) -> int:
    """Global images of the resumed epoch already trained, converted from the saving run's batches.

    The position is stored as batches of the saving run; times its batch size and world size it is a count of images
    of the epoch's order (``utils.training.sampler``), which this run skips whatever its own world size.
    """
    saved_args = payload.get(KEY_ARGS) or {}
    saved = BatchPlan(
        n_train=plan.n_train,
        batch_size=int(saved_args.get("batch_size", plan.batch_size)),
        world_size=int(payload.get(KEY_WORLD_SIZE) or 1),
        grad_accum=int(saved_args.get("grad_accum", plan.grad_accum)),
    )
    images = images_consumed(position.step_in_epoch, batch_size=saved.batch_size, world_size=saved.world_size)
    if (saved.world_size, saved.batch_size, saved.grad_accum) != (plan.world_size, plan.batch_size, plan.grad_accum):
        logger.warning(
            "the effective batch size changes from %d (%d process(es) x --batch-size %d x --grad-accum %d) in the "
            "checkpoint to %d (%d x %d x %d) in this run; consider scaling --learning-rate. The data continues from "
            "the same image (%d of this epoch done), but the steps are not bit-identical to an uninterrupted run",
            saved.images_per_step,
            saved.world_size,
            saved.batch_size,
            saved.grad_accum,
            plan.images_per_step,
            plan.world_size,
            plan.batch_size,
            plan.grad_accum,
            images,
        )
    return images


def _log_run_summary(
    config: TrainConfig,
    ctx: DistributedContext,
    data: TrainData,
    plan: BatchPlan,
    precision: str,
    num_workers: int,
    epochs: tuple[int, int],
    run_folder: RunFolder | None = None,
) -> None:
    logger.info(
        "Starting training: epochs %d..%d, batch size %d per process x %d process(es) x %d accumulation = %d, "
        "learning rate %g, %d training / %d validation images, scale %g, precision %s, device %s, "
        "%d CPU threads and %d loader workers per process, run folder %s",
        *epochs,
        plan.batch_size,
        plan.world_size,
        plan.grad_accum,
        plan.images_per_step,
        config.learning_rate,
        len(data.train_set),
        len(data.val_set),
        config.scale,
        precision,
        ctx.device,
        torch.get_num_threads(),
        num_workers,
        run_folder or RunFolder.of(config.checkpoint_dir, config.exp_name),
    )
