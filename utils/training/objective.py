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

Optimizer and schedule: AdamW + cosine (the default) or milesial's RMSprop + ReduceLROnPlateau, or nnU-Net's poly
schedule; any of them after a linear warmup (--warmup-steps). ``utils.training.step.TrainStep`` makes them
(``build_optimizer``, ``build_scheduler``), on every rank, before a resumed run restores their state.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, optim

from utils.datasets.mask_values import IGNORE_INDEX
from utils.errors import ConfigError
from utils.evaluation import dice_coeff, multiclass_dice_coeff
from utils.flags import parse_class_weights
from utils.training.config import OptimisationSection, TrainConfig

logger = logging.getLogger(__name__)

# nnU-Net: lr = base * (1 - t / T) ** 0.9.
POLY_EXPONENT = 0.9
# milesial/Pytorch-UNet: ReduceLROnPlateau('max', patience=5) on validation Dice.
PLATEAU_PATIENCE = 5
# --class-weights auto: no class weighs more than this many times the most frequent one.
MAX_CLASS_WEIGHT_RATIO = 10.0


def segmentation_loss(logits: Tensor, masks: Tensor, n_classes: int, class_weights: Tensor | None = None) -> Tensor:
    """Loss of ``[B, C, H, W]`` logits against ``[B, H, W]`` class indices; a mean over images of per-image means.

    Pixels equal to ``IGNORE_INDEX`` are left out; ``class_weights`` (one per class, two for ``n_classes == 1``:
    background, foreground) weight the cross-entropy term by each pixel's true class.
    """
    valid = masks != IGNORE_INDEX
    labels = masks.masked_fill(~valid, 0)
    # Void pixels count as neither prediction nor truth of any class in the Dice term.
    if n_classes == 1:
        binary_logits = logits[:, 0].float()
        target = labels.float()
        per_pixel = F.binary_cross_entropy_with_logits(binary_logits, target, reduction="none")
        dice = dice_coeff(binary_logits.sigmoid() * valid, target * valid, reduce_batch_first=False)
    else:
        logits = logits.float()
        per_pixel = F.cross_entropy(logits, labels, reduction="none")
        keep = valid.unsqueeze(1).to(logits.dtype)
        probabilities = logits.softmax(dim=1) * keep
        one_hot = F.one_hot(labels, n_classes).permute(0, 3, 1, 2).to(probabilities.dtype) * keep
        dice = multiclass_dice_coeff(probabilities, one_hot, reduce_batch_first=False)
    return _per_image_mean(per_pixel, labels, valid, class_weights) + 1 - dice


def supervised_loss(
    outputs: Tensor | Sequence[Tensor], masks: Tensor, n_classes: int, class_weights: Tensor | None = None
) -> Tensor:
    """``segmentation_loss`` of a model's output: the logits, or with --deep-supervision the list ``[logits, logits at
    1/2, logits at 1/4]`` (``unet.unet_model.AuxiliaryHeads``), whose losses against the masks downsampled (nearest,
    so void and class values stay whole) are summed with nnU-Net's weights: halving per level (1, 0.5, 0.25, ...),
    normalised to sum to 1. Each level is a per-image mean, so the sum still decomposes over data-parallel ranks."""
    if isinstance(outputs, Tensor):
        return segmentation_loss(outputs, masks, n_classes, class_weights)
    halving = [0.5**level for level in range(len(outputs))]
    total = torch.zeros((), device=masks.device)
    for weight, logits in zip(halving, outputs, strict=True):
        target = masks
        if logits.shape[-2:] != masks.shape[-2:]:
            # float32 holds every class index and IGNORE_INDEX exactly; interpolate has no integer kernel.
            nearest = F.interpolate(masks[:, None].float(), size=logits.shape[-2:], mode="nearest")
            target = nearest[:, 0].to(masks.dtype)
        total = total + weight / sum(halving) * segmentation_loss(logits, target, n_classes, class_weights)
    return total


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
    ``w_k = K * r_k / sum_j r_j`` for ``K`` classes; at least one pixel counted (``class_weights_of`` refuses
    masks without one, naming the flag).
    """
    total = sum(pixel_counts)
    inverse = [total / count if count > 0 else math.inf for count in pixel_counts]
    cap = max_ratio * min(inverse)
    clipped = [min(r, cap) for r in inverse]
    return [len(clipped) * r / sum(clipped) for r in clipped]


def class_weights_of(config: TrainConfig, train_class_pixels: Sequence[int]) -> tuple[float, ...] | None:
    """--class-weights as numbers: given, or 'auto' from the training images' class pixel counts (None: off)."""
    text, classes = config.optimisation.class_weights, config.model.classes
    if text is None:
        return None
    weights = parse_class_weights(text, classes)
    if weights is None:
        counts = list(train_class_pixels) + [0] * (max(classes, 2) - len(train_class_pixels))
        if sum(counts) == 0:
            raise ConfigError("--class-weights auto found no labelled pixels in the training masks; give the weights")
        weights = tuple(auto_class_weights(counts))
        logger.info(f"--class-weights auto: class pixel counts {counts} give weights {[round(w, 4) for w in weights]}")
    return weights


def build_optimizer(config: OptimisationSection, parameters: Iterable[torch.nn.Parameter]) -> optim.Optimizer:
    both = {"lr": config.learning_rate, "weight_decay": config.weight_decay}
    if config.optimizer == "rmsprop":
        return optim.RMSprop(parameters, momentum=config.momentum, foreach=True, **both)
    parameters = list(parameters)
    # The fused kernel updates each tensor in one pass instead of a dozen: on CPU about 3x faster than the default
    # per-tensor loop for the 31M-parameter UNet, and as exact and deterministic. It exists for CPU and CUDA tensors.
    fused = all(p.device.type in ("cpu", "cuda") for p in parameters)
    return optim.AdamW(parameters, fused=fused or None, **both)


@dataclass
class StepSchedule:
    """The learning-rate schedule of a run as a multiplier of the peak rate, planned when the run started.

    For the update after ``step`` optimizer steps: a linear warmup ``(step + 1) / (warmup_steps + 1)`` for the
    first ``warmup_steps`` steps (the first update already moves, and the rise reaches the peak at step
    ``warmup_steps``), then the cosine ``(1 + cos(pi * p)) / 2`` or nnU-Net's poly ``(1 - p) ** 0.9`` ``shape``, at
    progress ``p`` through the remaining ``total_steps - warmup_steps`` steps (1 when the warmup leaves none: a
    constant rate; 0 from ``total_steps`` on).

    LambdaLR keeps a callable object's attributes in its ``state_dict``, so the plan (total and warmup steps, shape)
    travels in the checkpoint and a resumed run continues the same curve whatever the flags of the resuming command
    say: these three attributes are the checkpoints' keys.
    """

    total_steps: int
    warmup_steps: int = 0
    shape: str = "cosine"

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        remaining = self.total_steps - self.warmup_steps
        progress = min(step - self.warmup_steps, remaining) / remaining if remaining > 0 else 0.0
        if self.shape == "poly":
            return (1.0 - progress) ** POLY_EXPONENT
        return 0.5 * (1.0 + math.cos(math.pi * progress))


class PlateauAfterWarmup:
    """--scheduler plateau with --warmup-steps: a linear warmup per optimizer step, then ReduceLROnPlateau.

    ``step()`` (after every optimizer step) advances the warmup until it is over; ``step(dice)`` (after a
    validation) steps the plateau schedule once the warmup is over: a validation inside the warmup does not count
    towards its patience, and the warmup never overwrites a reduction.
    """

    def __init__(self, optimizer: optim.Optimizer, warmup_steps: int) -> None:
        self.warmup = optim.lr_scheduler.LambdaLR(optimizer, StepSchedule(0, warmup_steps))
        self.plateau = optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", patience=PLATEAU_PATIENCE)

    def step(self, metrics: float | None = None) -> None:
        # The warmup's own plan (a StepSchedule, restored with its state) says when it is over.
        warming_up = self.warmup.last_epoch < self.warmup.lr_lambdas[0].warmup_steps
        if metrics is None:
            if warming_up:
                self.warmup.step()
        elif not warming_up:
            self.plateau.step(metrics)

    def state_dict(self) -> dict[str, Any]:
        return {"warmup": self.warmup.state_dict(), "plateau": self.plateau.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.warmup.load_state_dict(state["warmup"])
        self.plateau.load_state_dict(state["plateau"])


def build_scheduler(config: OptimisationSection, optimizer: optim.Optimizer, total_steps: int) -> Any:
    """Cosine and poly: pure functions of the step count (stepped per optimizer step) over the steps planned when
    the run started (``total_steps``, from ``BatchPlan``; ``load_state_dict`` restores a checkpoint's plan), after
    ``warmup_steps`` of linear warmup. Plateau: stepped with the validation Dice (after the warmup, if any)."""
    if config.scheduler == "plateau":
        if config.warmup_steps:
            return PlateauAfterWarmup(optimizer, config.warmup_steps)
        return optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", patience=PLATEAU_PATIENCE)
    return optim.lr_scheduler.LambdaLR(optimizer, StepSchedule(total_steps, config.warmup_steps, config.scheduler))
