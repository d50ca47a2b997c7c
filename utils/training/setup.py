"""Wiring a training run from the parsed flags: the builders that read ``TrainConfig`` are called from here.

``build_parts`` wires three builders, each handed the config sections it reads: the model
(``utils.training.model``), the step with its optimisation (``utils.training.step``, from ``objective``'s builders)
and the loaders (``utils.training.data``). The batch arithmetic (``BatchPlan``) is made once here and handed down.

Every rank builds its own copy (per the PyTorch DDP tutorial: each rank loads the checkpoint before wrapping the model
in DDP). Decisions that depend on the run folder (which checkpoint to resume, whether the folder is taken) are made
by global rank 0, the folder's only writer, and broadcast; a user error on any rank stops every rank with its message
instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from typing import Any

import numpy as np
import torch

from utils.checkpoint.checkpointer import restore
from utils.checkpoint.files import load_resume_checkpoint, write_run_text
from utils.checkpoint.format import TrainingState, TrainPosition
from utils.checkpoint.run_folder import RunChoice, RunSeries, agree_on_run, series_name
from utils.errors import ConfigError, count
from utils.flags import flag_fields
from utils.hardware import resolve_precision, reuse_large_buffers, warn_if_emulated
from utils.launch.environments import LaunchPlan
from utils.launch.process_group import DistributedContext, agree_on_errors, setup
from utils.launch.signals import InterruptFlag
from utils.training.compiled import use_compile_cache, warn_if_slower
from utils.training.config import MUST_MATCH, NEW_PLAN, TrainConfig, describe_flag
from utils.training.data import build_data, build_loaders
from utils.training.loop import Trainer
from utils.training.model import check_resume, starting_model
from utils.training.objective import class_weights_of
from utils.training.parts import TrainParts
from utils.training.sampler import BatchPlan
from utils.training.step import TrainStep

logger = logging.getLogger(__name__)


def join(config: TrainConfig, plan: LaunchPlan) -> DistributedContext:
    """Pick the device, size the thread pool and join the process group, as the flags say."""
    # Every step makes the same large tensors (and on a CPU, loading in this process, every item): keep their memory
    # for reuse instead of faulting in fresh pages each time (utils.hardware; 1.2-1.3x bf16 images/s on the 2-core
    # machine of docs/PERFORMANCE.md).
    reuse_large_buffers()
    return setup(plan, config.performance, config.launch)


def build_trainer(config: TrainConfig, ctx: DistributedContext, interrupts: InterruptFlag) -> Trainer:
    folder, data = config.checkpoint, config.data
    series = RunSeries(folder.checkpoint_dir, series_name(folder.exp_name, data.fold if data.folds else None))
    choice = agree_on_run(ctx, folder.resume, series)
    try:
        configure_reproducibility(data.seed, deterministic=config.optimisation.deterministic)
        parts = agree_on_errors(ctx, lambda: build_parts(config, ctx, choice))
        return agree_on_errors(ctx, lambda: Trainer(ctx, parts, interrupts))
    except BaseException:
        choice.folder.unlock()
        raise


# ------------------------------------------------------------------------------------------------ the run


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


def build_parts(config: TrainConfig, ctx: DistributedContext, choice: RunChoice) -> TrainParts:
    """Everything the loop needs, in the run folder ``choice`` names, restored from its checkpoint: wires the model,
    optimisation and loader builders.

    ``choice.state``: the checkpoint's state where this process has read it already (global rank 0, which chose it);
    the other ranks read the file here.
    """
    state, resume_path, run_folder = choice.state, choice.resume_path, choice.folder
    if resume_path is not None:
        state = state or load_resume_checkpoint(resume_path)
        logger.info("Resuming from %s", resume_path)
        config = check_resume_flags(config, state, resume_path)
    data, flags = build_data(config), config.optimisation
    plan = BatchPlan(
        n_train=len(data.train_set), batch_size=flags.batch_size, world_size=ctx.world_size, grad_accum=flags.grad_accum
    )
    if plan.batch_size > (per_rank := plan.images_per_rank()):
        raise ConfigError(
            f"--batch-size {plan.batch_size} is larger than the {per_rank} training images each of the "
            f"{plan.world_size} process(es) gets ({plan.n_train} in total); use --batch-size {per_rank} or less"
        )
    precision = resolve_precision(config.performance.precision, config.performance.amp, ctx.device.type)
    warn_if_emulated(ctx.device, precision)
    if config.performance.compile:
        use_compile_cache(run_folder.compile_cache)
        warn_if_slower(ctx.device, precision)
    if state is not None:
        check_resume(config, data, state, resume_path)
    model = starting_model(config, ctx, data, resuming=state is not None)
    if ctx.is_main:
        write_run_text(run_folder.split, data.split.file_text())
    # The schedule's plan; a resumed run's scheduler state brings back the plan it was made with.
    total_steps = plan.total_steps(flags.epochs)
    if state is None and flags.warmup_steps >= total_steps and flags.scheduler != "plateau":
        logger.warning(
            f"--warmup-steps {flags.warmup_steps} is not shorter than the run's {total_steps} optimizer steps: the "
            f"learning rate never reaches the {flags.scheduler} schedule"
        )
    class_weights = class_weights_of(config, data.train_class_pixels)
    step = TrainStep(config, model, ctx, precision=precision, total_steps=total_steps, class_weights=class_weights)
    position, resume_images = TrainPosition(epoch=config.checkpoint.start_from - 1), 0
    if state is not None:
        stepped = {"optimizer": step.optimizer, "scheduler": step.scheduler, "scaler": step.scaler, "ema": step.ema}
        restore(state, {"model": model, **stepped})
        position, resume_images = state.position, _resumed_images_in_epoch(plan, state)
    loaders = build_loaders(config, ctx, data)
    return TrainParts(step, data, loaders, plan, config, run_folder, position, resume_images, resumed=state is not None)


def check_resume_flags(config: TrainConfig, state: TrainingState, path: str) -> TrainConfig:
    """The config of a run that resumes ``state``: the resume rules (each flag's ``resume=``, ``utils.flags``) applied
    to this command's flags.

    A ``must match`` flag that differs from the run's, set or unset alike, is refused: the optimizer restores its own
    learning rate, weight decay and momentum from the checkpoint (a new value would be logged but not used), the data
    flags decide which images are trained and which validate (a larger --validation would move trained images into
    the validation set), the objective's flags decide what the loss measures, --ema's decay made the average the
    checkpoint holds, and the model's arguments made its weights. A ``may change`` flag takes its new value, said in
    one line. A ``new plan`` flag is the run's: the epoch plan is made once, when the run starts, and resuming
    continues it whatever --epochs/--start_from say now (to train on with another plan, start a new run from the
    weights with --load and --start_from). docs/RELIABILITY.md, "What a resume takes".

    A flag missing from the checkpoint's record (saved before the flag existed) counts as its default, the behaviour
    that run had; a checkpoint recording no flags at all is not checked.
    """
    saved_args, wanted_args = state.run_args, config.as_dict()
    if not saved_args:
        return config
    changed = []
    for item in flag_fields(TrainConfig):
        rule, flag = item.flag.resume, item.flag.name
        saved, wanted = saved_args.get(item.dest, item.default), wanted_args[item.dest]
        if rule == NEW_PLAN or _as_recorded(saved) == _as_recorded(wanted):
            continue
        if rule == MUST_MATCH:
            raise ConfigError(
                f"{path} was trained with {describe_flag(flag, saved)} but this run asks for "
                f"{describe_flag(flag, wanted)}; resume with {describe_flag(flag, saved)}, or start a new run from "
                f"its weights with --load {path}"
            )
        changed.append(f"{describe_flag(flag, saved)} -> {describe_flag(flag, wanted)}")
    if changed:
        logger.info("The resumed run changes %s: %s", count(len(changed), "flag"), ", ".join(changed))
    if "epochs" not in saved_args or "start_from" not in saved_args:
        return config
    plan = {"epochs": int(saved_args["epochs"]), "start_from": int(saved_args["start_from"])}
    planned = TrainConfig.from_dict(wanted_args | plan)
    if planned != config:
        first, last = planned.epoch_range()
        logger.warning(
            f"--resume continues the run's plan, epochs {first}..{last} (--start_from {plan['start_from']} --epochs "
            f"{plan['epochs']}); this command's --start_from {config.checkpoint.start_from} --epochs "
            f"{config.optimisation.epochs} are ignored"
        )
    return planned


def _as_recorded(value: Any) -> Any:
    """A flag's value as a checkpoint records it (lists and tuples alike, in any order)."""
    if isinstance(value, list | tuple):
        return sorted(value)
    return value


def _resumed_images_in_epoch(plan: BatchPlan, state: TrainingState) -> int:
    """Global images of the resumed epoch already trained, converted from the saving run's batches.

    The position is stored as batches of the saving run; times its batch size and world size it is a count of images
    of the epoch's order (``utils.training.sampler``), which this run skips whatever its own world size.
    """
    args = state.run_args  # a flag the checkpoint does not record was at this run's value
    batch_size, grad_accum = int(args.get("batch_size", plan.batch_size)), int(args.get("grad_accum", plan.grad_accum))
    saved = dataclasses.replace(plan, batch_size=batch_size, world_size=state.world_size, grad_accum=grad_accum)
    images = saved.images_consumed(state.position.step_in_epoch)
    if saved != plan:
        logger.warning(
            f"the effective batch size changes from {saved.images_per_step} ({saved.world_size} process(es) x "
            f"--batch-size {saved.batch_size} x --grad-accum {saved.grad_accum}) in the checkpoint to "
            f"{plan.images_per_step} ({plan.world_size} x {plan.batch_size} x {plan.grad_accum}) in this run; "
            f"consider scaling --learning-rate. The data continues from the same image ({images} of this epoch "
            f"done), but the steps are not bit-identical to an uninterrupted run"
        )
    return images
