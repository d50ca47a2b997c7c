"""What training minimises and how: the loss, the optimizer and the learning-rate schedule.

The loss is milesial/Pytorch-UNet's recipe: cross-entropy + Dice for 2+ classes, BCE + Dice for one class. One
difference: the Dice term is computed per image and averaged (``reduce_batch_first=False``) instead of over the batch
as one volume. A per-image mean decomposes over data-parallel ranks with equal batch sizes (the DDP gradient average
of the ranks' losses equals the gradient of the loss of the global batch), so N processes with batch b train exactly
like one process with batch N*b. A batch-volume Dice does not decompose: its ratio of sums would depend on how the
global batch is split.

The cross-entropy (BCE) term is likewise a mean over images of each image's mean over its pixels, so it decomposes
the same way. Void pixels (``IGNORE_INDEX``, from --ignore-value) count in neither term. Class weights (--class-weights)
weight each pixel's cross-entropy by its true class, and each image's term is then the weighted mean
``sum(w[y] * ce) / sum(w[y])`` over its pixels, PyTorch's ``cross_entropy(weight=...)`` applied per image.

Optimizer and schedule: AdamW + cosine (the default) or milesial's RMSprop + ReduceLROnPlateau.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, optim

from utils.datasets.mask_values import IGNORE_INDEX
from utils.dice_score import dice_coeff, multiclass_dice_coeff

OPTIMIZERS = ("adamw", "rmsprop")
SCHEDULERS = ("cosine", "plateau")
# milesial/Pytorch-UNet: ReduceLROnPlateau('max', patience=5) on validation Dice.
PLATEAU_PATIENCE = 5
CLASS_WEIGHTS_AUTO = "auto"
# --class-weights auto: no class weighs more than this many times the most frequent one.
MAX_CLASS_WEIGHT_RATIO = 10.0


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer and schedule of a run (from --optimizer, -l, --weight-decay, --momentum, --scheduler)."""

    name: str = "adamw"
    learning_rate: float = 1e-5
    weight_decay: float = 1e-8
    momentum: float = 0.999
    """RMSprop only."""
    scheduler: str = "cosine"


def segmentation_loss(logits: Tensor, masks: Tensor, n_classes: int, class_weights: Tensor | None = None) -> Tensor:
    """Loss of ``[B, C, H, W]`` logits against ``[B, H, W]`` class indices; a mean over images of per-image means.

    Pixels equal to ``IGNORE_INDEX`` are left out; ``class_weights`` (one per class, two for ``n_classes == 1``:
    background, foreground) weight the cross-entropy term by each pixel's true class.
    """
    valid = masks != IGNORE_INDEX
    labels = masks.masked_fill(~valid, 0)
    if n_classes == 1:
        binary_logits = logits[:, 0].float()
        target = labels.float()
        per_pixel = F.binary_cross_entropy_with_logits(binary_logits, target, reduction="none")
        cross_entropy = _per_image_mean(per_pixel, labels, valid, class_weights)
        probabilities, target = binary_logits.sigmoid() * valid, target * valid
        return cross_entropy + 1 - dice_coeff(probabilities, target, reduce_batch_first=False)
    logits = logits.float()
    per_pixel = F.cross_entropy(logits, labels, reduction="none")
    cross_entropy = _per_image_mean(per_pixel, labels, valid, class_weights)
    # Void pixels count as neither prediction nor truth of any class in the Dice term.
    keep = valid.unsqueeze(1).to(logits.dtype)
    probabilities = logits.softmax(dim=1) * keep
    one_hot = F.one_hot(labels, n_classes).permute(0, 3, 1, 2).to(probabilities.dtype) * keep
    return cross_entropy + 1 - multiclass_dice_coeff(probabilities, one_hot, reduce_batch_first=False)


def _per_image_mean(per_pixel: Tensor, labels: Tensor, valid: Tensor, class_weights: Tensor | None) -> Tensor:
    """Mean over images of each image's (class-weighted) mean over its valid pixels; an all-void image adds 0."""
    weights = valid.to(per_pixel.dtype)
    if class_weights is not None:
        weights = weights * class_weights.to(per_pixel.device, per_pixel.dtype)[labels]
    totals = (per_pixel * weights).flatten(1).sum(dim=1)
    return (totals / weights.flatten(1).sum(dim=1).clamp_min(torch.finfo(per_pixel.dtype).tiny)).mean()


def auto_class_weights(pixel_counts: Sequence[int], max_ratio: float = MAX_CLASS_WEIGHT_RATIO) -> list[float]:
    """--class-weights auto: inverse class frequency, clipped and normalised to a mean of 1.

    With ``n_k`` the pixels of class ``k`` and ``f_k = n_k / sum(n)``: ``r_k = 1 / f_k``, clipped to
    ``min(r_k, max_ratio * min_j r_j)`` (a class absent from the counts gets the cap), then
    ``w_k = K * r_k / sum_j r_j`` for ``K`` classes.
    """
    total = sum(pixel_counts)
    if total <= 0 or not pixel_counts:
        raise ValueError("auto_class_weights needs at least one counted pixel")
    inverse = [total / count if count > 0 else math.inf for count in pixel_counts]
    cap = max_ratio * min(inverse)
    clipped = [min(r, cap) for r in inverse]
    return [len(clipped) * r / sum(clipped) for r in clipped]


def cosine_lr_factor(step: int, total_steps: int) -> float:
    """Multiplier of the peak learning rate after ``step`` optimizer steps: 1 at step 0, falling to 0 at ``total``."""
    if total_steps <= 0:
        return 1.0
    progress = min(step, total_steps) / total_steps
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(config: OptimizerConfig, parameters: Iterable[torch.nn.Parameter]) -> optim.Optimizer:
    if config.name == "rmsprop":
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


@dataclass
class CosineSchedule:
    """``cosine_lr_factor`` over a plan of ``total_steps``. LambdaLR keeps a callable object's attributes in its
    ``state_dict``, so the plan travels in the checkpoint and a resumed run continues it exactly."""

    total_steps: int

    def __call__(self, step: int) -> float:
        return cosine_lr_factor(step, self.total_steps)


def build_scheduler(config: OptimizerConfig, optimizer: optim.Optimizer, total_steps: int) -> Any:
    """Cosine: a pure function of the step count (stepped per optimizer step) over the steps planned when the run
    started (``total_steps``; ``load_state_dict`` restores a checkpoint's). Plateau: stepped with the validation
    Dice."""
    if config.scheduler == "plateau":
        return optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", patience=PLATEAU_PATIENCE)
    return optim.lr_scheduler.LambdaLR(optimizer, CosineSchedule(total_steps))
