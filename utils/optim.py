"""Optimizer and learning-rate schedule: AdamW + cosine (default) or milesial's RMSprop + ReduceLROnPlateau."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import optim

from .config import TrainConfig

# milesial/Pytorch-UNet: ReduceLROnPlateau('max', patience=5) on validation Dice.
PLATEAU_PATIENCE = 5


def cosine_lr_factor(step: int, total_steps: int) -> float:
    """Multiplier of the peak learning rate after ``step`` optimizer steps: 1 at step 0, falling to 0 at ``total``."""
    if total_steps <= 0:
        return 1.0
    progress = min(step, total_steps) / total_steps
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(config: TrainConfig, parameters: Iterable[torch.nn.Parameter]) -> optim.Optimizer:
    if config.optimizer == "rmsprop":
        return optim.RMSprop(
            parameters,
            lr=config.learning_rate,
            weight_decay=config.weight_decay,
            momentum=config.momentum,
            foreach=True,
        )
    parameters = list(parameters)
    # The fused kernel updates each tensor in one pass instead of a dozen: on CPU about 3x faster than the default
    # per-tensor loop for the 31M-parameter UNet, and as exact and deterministic. It exists for CPU and CUDA tensors.
    fused = all(p.device.type in ("cpu", "cuda") for p in parameters)
    return optim.AdamW(parameters, lr=config.learning_rate, weight_decay=config.weight_decay, fused=fused or None)


def build_scheduler(config: TrainConfig, optimizer: optim.Optimizer, total_steps: int) -> Any:
    """Cosine: a pure function of the step count (stepped per optimizer step), so it is exact on resume and
    re-planned when a resumed run changes --epochs. Plateau: stepped with the validation Dice."""
    if config.scheduler == "plateau":
        return optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", patience=PLATEAU_PATIENCE)
    return optim.lr_scheduler.LambdaLR(optimizer, lambda step: cosine_lr_factor(step, total_steps))
