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
from utils.training.config import OptimisationSection, TrainConfig, parse_class_weights
from utils.training.data import TrainData
from utils.training.objective import auto_class_weights, build_optimizer, build_scheduler, steps_every_update
from utils.training.step import TrainStep

logger = logging.getLogger(__name__)


@dataclass
class Optimization:
    """The optimizer of a run and what steps along with it."""

    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler | None
    """fp16 only: the gradient scaler."""


def build_optimization(
    config: OptimisationSection,
    parameters: Iterable[torch.nn.Parameter],
    *,
    total_steps: int,
    precision: str,
    resumed: bool,
) -> Optimization:
    """Optimizer, schedule (planned over ``total_steps``) and scaler; a resumed run restores their state after."""
    if not resumed and config.warmup_steps >= total_steps and config.scheduler != "plateau":
        logger.warning(
            "--warmup-steps %d is not shorter than the run's %d optimizer steps: the learning rate never reaches the "
            "%s schedule",
            config.warmup_steps,
            total_steps,
            config.scheduler,
        )
    optimizer = build_optimizer(config, parameters)
    # Planned for the run's epochs; a resumed run's scheduler state brings back the plan it was made with.
    scheduler = build_scheduler(config, optimizer, total_steps)
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
        config,
        precision=precision,
        class_weights=class_weights_of(config, data),
        model=model,
        raw_model=raw_model,
        optimizer=optimization.optimizer,
        # ReduceLROnPlateau steps on validation Dice, in the loop; only its warmup (if any) steps after every update.
        scheduler=optimization.scheduler if steps_every_update(config.optimisation) else None,
        scaler=optimization.scaler,
        device=device,
    )


def class_weights_of(config: TrainConfig, data: TrainData) -> tuple[float, ...] | None:
    """--class-weights as numbers: given, or 'auto' from the training images' class pixel counts (None: off)."""
    text, classes = config.optimisation.class_weights, config.model.classes
    if text is None:
        return None
    weights = parse_class_weights(text, classes)
    if weights is None:
        counts = list(data.train_class_pixels) + [0] * (max(classes, 2) - len(data.train_class_pixels))
        if sum(counts) == 0:
            raise ConfigError("--class-weights auto found no labelled pixels in the training masks; give the weights")
        weights = tuple(auto_class_weights(counts))
        logger.info(
            "--class-weights auto: class pixel counts %s give weights %s", counts, [round(w, 4) for w in weights]
        )
    return weights
