"""Validation: per-class Dice and IoU of a model over a data loader.

Each image gets a Dice and an IoU per class from its own pixel counts; the dataset score is the mean over images, so
it does not depend on the batch size or on how images are grouped. The headline ``dice``/``iou`` average the
foreground classes (class 0 is background), which is what milesial/Pytorch-UNet reports as validation Dice.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from tqdm import tqdm

from utils.dice_score import confusion_counts, dice_from_counts, iou_from_counts
from utils.hardware import autocast


@dataclass
class EvalResult:
    """Scores over a dataset; per-class lists are indexed by class (0 = background)."""

    dice: float
    iou: float
    per_class_dice: list[float]
    per_class_iou: list[float]
    n_images: int

    def as_dict(self) -> dict[str, float | int | list[float]]:
        return {
            "dice": self.dice,
            "iou": self.iou,
            "per_class_dice": self.per_class_dice,
            "per_class_iou": self.per_class_iou,
            "n_images": self.n_images,
        }


@dataclass
class SegmentationMetrics:
    """Accumulates per-image Dice and IoU per class; ``n_classes`` counts background (2 for binary models)."""

    n_classes: int
    _dice_sum: Tensor = field(init=False)
    _iou_sum: Tensor = field(init=False)
    _n_images: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._dice_sum = torch.zeros(self.n_classes, dtype=torch.float64)
        self._iou_sum = torch.zeros(self.n_classes, dtype=torch.float64)

    def update(self, pred: Tensor, target: Tensor) -> None:
        """Add a ``[B, H, W]`` batch of predicted and true class indices."""
        counts = confusion_counts(pred, target, self.n_classes)
        self._dice_sum += dice_from_counts(*counts).sum(dim=0)
        self._iou_sum += iou_from_counts(*counts).sum(dim=0)
        self._n_images += pred.shape[0]

    def compute(self) -> EvalResult:
        if self._n_images == 0:
            raise ValueError("no images were evaluated: the validation set is empty")
        per_class_dice = (self._dice_sum / self._n_images).tolist()
        per_class_iou = (self._iou_sum / self._n_images).tolist()
        # With one class only (a degenerate model) there is no foreground; report that class itself.
        foreground = slice(1, None) if self.n_classes > 1 else slice(None)
        return EvalResult(
            dice=float(torch.tensor(per_class_dice[foreground]).mean()),
            iou=float(torch.tensor(per_class_iou[foreground]).mean()),
            per_class_dice=per_class_dice,
            per_class_iou=per_class_iou,
            n_images=self._n_images,
        )


def predict_classes(logits: Tensor, threshold: float = 0.5) -> Tensor:
    """``[B, C, H, W]`` logits to ``[B, H, W]`` class indices: sigmoid threshold for one logit, argmax otherwise."""
    if logits.shape[1] == 1:
        return (torch.sigmoid(logits[:, 0].float()) > threshold).long()
    return logits.argmax(dim=1)


def run_model(model: nn.Module, images: Tensor, precision: str) -> Tensor:
    """Forward pass under ``precision``; logits come back as float32."""
    with autocast(images.device, precision):
        logits = model(images)
    return logits.float()


@torch.inference_mode()
def evaluate(
    model: nn.Module,
    dataloader: Iterable[dict[str, Tensor]],
    device: torch.device,
    *,
    n_classes: int,
    precision: str = "fp32",
    progress: bool = True,
) -> EvalResult:
    """Score ``model`` (the unwrapped module, never a DDP wrapper) on every batch of ``dataloader``.

    The model is put in eval mode and its previous mode restored, so BatchNorm buffers are not touched.
    """
    was_training = model.training
    model.eval()
    metrics = SegmentationMetrics(n_classes=max(n_classes, 2))
    try:
        for batch in tqdm(dataloader, desc="Validation", unit="batch", leave=False, disable=not progress):
            images = batch["image"].to(device=device, dtype=torch.float32, non_blocking=True)
            true_masks = batch["mask"].to(device=device, dtype=torch.long, non_blocking=True)
            metrics.update(predict_classes(run_model(model, images, precision)).cpu(), true_masks.cpu())
    finally:
        model.train(was_training)
    return metrics.compute()
