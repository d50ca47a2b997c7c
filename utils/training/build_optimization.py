"""How a training run optimises: the optimizer, schedule and gradient scaler, and the ``TrainStep`` that uses them.

Built by ``utils.training.setup.build_parts`` on every rank, restored from the checkpoint being resumed. The rules
themselves live in ``utils.training.objective`` (loss, optimizer, schedule) and ``utils.training.step``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from utils.errors import ConfigError
from utils.training.config import TrainConfig, parse_class_weights
from utils.training.data import TrainData
from utils.training.objective import (
    OptimizerConfig,
    auto_class_weights,
    build_optimizer,
    build_scheduler,
    steps_every_update,
)
from utils.training.step import StepConfig, TrainStep

logger = logging.getLogger(__name__)


@dataclass
class Optimization:
    """The optimizer of a run and what steps along with it."""

    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler | None
    """fp16 only: the gradient scaler."""


def optimizer_config(config: TrainConfig) -> OptimizerConfig:
    return OptimizerConfig(
        name=config.optimizer,
        learning_rate=config.learning_rate,
        weight_decay=config.weight_decay,
        momentum=config.momentum,
        scheduler=config.scheduler,
        warmup_steps=config.warmup_steps,
    )


def build_optimization(
    config: TrainConfig,
    parameters: Iterable[torch.nn.Parameter],
    *,
    total_steps: int,
    precision: str,
    resumed: bool,
) -> Optimization:
    """Optimizer, schedule (planned over ``total_steps``) and scaler; a resumed run restores their state after."""
    settings = optimizer_config(config)
    if not resumed and settings.warmup_steps >= total_steps and settings.scheduler != "plateau":
        logger.warning(
            "--warmup-steps %d is not shorter than the run's %d optimizer steps: the learning rate never reaches the "
            "%s schedule",
            settings.warmup_steps,
            total_steps,
            settings.scheduler,
        )
    optimizer = build_optimizer(settings, parameters)
    # Planned for the run's epochs; a resumed run's scheduler state brings back the plan it was made with.
    scheduler = build_scheduler(settings, optimizer, total_steps)
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    return Optimization(optimizer, scheduler, scaler)


def build_step(
    config: TrainConfig,
    optimization: Optimization,
    *,
    model: torch.nn.Module,
    raw_model: torch.nn.Module,
    data: TrainData,
    precision: str,
    device: torch.device,
) -> TrainStep:
    """The optimizer step over ``model`` (what the forward pass calls; ``raw_model`` unwrapped)."""
    return TrainStep(
        step_config(config, precision, class_weights_of(config, data)),
        model=model,
        raw_model=raw_model,
        optimizer=optimization.optimizer,
        # ReduceLROnPlateau steps on validation Dice, in the loop; only its warmup (if any) steps after every update.
        scheduler=optimization.scheduler if steps_every_update(optimizer_config(config)) else None,
        scaler=optimization.scaler,
        device=device,
    )


def step_config(config: TrainConfig, precision: str, class_weights: tuple[float, ...] | None) -> StepConfig:
    return StepConfig(
        n_classes=config.classes,
        precision=precision,
        grad_clip=config.grad_clip,
        channels_last=config.channels_last,
        class_weights=class_weights,
        freeze_encoder_before_epoch=config.start_from - 1 + config.freeze_encoder_epochs
        if config.freeze_encoder_epochs
        else 0,
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
