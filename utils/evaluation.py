"""Validation: per-class Dice and IoU of a model over a data loader.

Two reductions, named as in segmentation_models_pytorch's metrics:

* **macro** (per image, then the mean over images): each image gets a Dice and an IoU per class from its own pixel
  counts; the dataset score is their mean, so it does not depend on the batch size or on how images are grouped.
  This is the headline ``dice``/``iou`` and ``per_class_dice``/``per_class_iou`` (smp's "macro-imagewise" per class).
* **micro** (dataset level): each class's true/false positive and false negative pixels are summed over the whole
  dataset first and scored once (smp's per-class "micro"); large images and large objects weigh more.

Each is reported per class and averaged over the classes with and without background (``dice``/``iou``: the foreground
classes 1..K-1, which is what milesial/Pytorch-UNet reports as validation Dice; ``*_with_background``: all K).

A class absent from both the prediction and the truth scores 1 (there was nothing to find and nothing was found):
per image for macro, over the whole dataset for micro. It keeps an image without a rare class from counting as a
failure on that class, and it raises macro scores on datasets where most images lack most classes. Void pixels
(``IGNORE_INDEX``, from --ignore-value) count in no reduction.

Two entry points: ``evaluate(net, dataloader, device, amp)`` is milesial/Pytorch-UNet's signature and returns the
mean Dice as a float (it also takes the documented DDP script's ``disable_log=``); ``evaluate_segmentation`` returns
the full ``EvalResult`` (per-class Dice and IoU) and is what training and ``evaluate.py`` use.

Sharded validation (``train.py --val-mode sharded``): each rank scores the images of ``shard_range``
(``score_batches``), then ``SegmentationMetrics.reduce`` sums over ranks. Every score is a ratio of sums (per-image
scores, pixel counts, the image count), so the reduced sums give the scores of one rank that scored everything, up to
float64 rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from tqdm import tqdm

from utils.dice_score import confusion_counts, dice_from_counts, iou_from_counts
from utils.hardware import autocast, resolve_precision


@dataclass
class EvalResult:
    """Scores over a dataset; per-class lists are indexed by class (0 = background)."""

    dice: float
    iou: float
    per_class_dice: list[float]
    per_class_iou: list[float]
    n_images: int
    micro_per_class_dice: list[float] = field(default_factory=list)
    """Per class, from the pixel counts summed over the dataset (the micro reduction)."""
    micro_per_class_iou: list[float] = field(default_factory=list)

    def reductions(self) -> dict[str, dict[str, Any]]:
        """Both reductions, each per class and averaged with and without background, saying which is which."""
        return {
            "macro": {"reduction": MACRO_DESCRIPTION, **_averages(self.per_class_dice, self.per_class_iou)},
            "micro": {"reduction": MICRO_DESCRIPTION, **_averages(self.micro_per_class_dice, self.micro_per_class_iou)},
        }

    def as_dict(self) -> dict[str, Any]:
        """The headline (macro, foreground) scores at the top level as before, both reductions under ``reductions``."""
        return {
            "dice": self.dice,
            "iou": self.iou,
            "per_class_dice": self.per_class_dice,
            "per_class_iou": self.per_class_iou,
            "n_images": self.n_images,
            "headline": "dice, iou and per_class_* are the macro reduction; dice and iou average classes 1..K-1",
            "absent_class": ABSENT_CLASS_CONVENTION,
            "reductions": self.reductions(),
        }


MACRO_DESCRIPTION = "macro: Dice/IoU per image from its own pixel counts, then the mean over images"
MICRO_DESCRIPTION = "micro: pixel counts summed over the dataset per class, then one Dice/IoU per class"
ABSENT_CLASS_CONVENTION = (
    "a class absent from both prediction and truth scores 1 (per image for macro, over the dataset for micro)"
)


def _averages(per_class_dice: list[float], per_class_iou: list[float]) -> dict[str, Any]:
    # With one class only (a degenerate model) there is no foreground; its mean is that class itself.
    foreground = slice(1, None) if len(per_class_dice) > 1 else slice(None)
    return {
        "per_class_dice": per_class_dice,
        "per_class_iou": per_class_iou,
        "dice": _mean(per_class_dice[foreground]),
        "iou": _mean(per_class_iou[foreground]),
        "dice_with_background": _mean(per_class_dice),
        "iou_with_background": _mean(per_class_iou),
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


@dataclass
class SegmentationMetrics:
    """Accumulates per-image Dice and IoU per class; ``n_classes`` counts background (2 for binary models)."""

    n_classes: int
    _dice_sum: Tensor = field(init=False)
    _iou_sum: Tensor = field(init=False)
    _counts_sum: Tensor = field(init=False)
    """True positives, false positives and false negatives per class, summed over images: ``[3, n_classes]``."""
    _n_images: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._dice_sum = torch.zeros(self.n_classes, dtype=torch.float64)
        self._iou_sum = torch.zeros(self.n_classes, dtype=torch.float64)
        self._counts_sum = torch.zeros(3, self.n_classes, dtype=torch.float64)

    def update(self, pred: Tensor, target: Tensor) -> None:
        """Add a ``[B, H, W]`` batch of predicted and true class indices."""
        counts = confusion_counts(pred, target, self.n_classes)
        self._dice_sum += dice_from_counts(*counts).sum(dim=0)
        self._iou_sum += iou_from_counts(*counts).sum(dim=0)
        self._counts_sum += torch.stack([count.sum(dim=0) for count in counts])
        self._n_images += pred.shape[0]

    def reduce(self, reduce_sums: Callable[[Tensor], Tensor]) -> None:
        """Replace every sum by ``reduce_sums`` of it (the sum over ranks): one float64 vector, one collective."""
        k = self.n_classes
        packed = torch.cat(
            [
                self._dice_sum,
                self._iou_sum,
                self._counts_sum.flatten(),
                torch.tensor([self._n_images], dtype=torch.float64),
            ]
        )
        total = reduce_sums(packed).cpu()
        self._dice_sum, self._iou_sum = total[:k].clone(), total[k : 2 * k].clone()
        self._counts_sum = total[2 * k : 5 * k].reshape(3, k).clone()
        self._n_images = int(round(float(total[5 * k])))

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
            micro_per_class_dice=dice_from_counts(*self._counts_sum).tolist(),
            micro_per_class_iou=iou_from_counts(*self._counts_sum).tolist(),
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
def evaluate_segmentation(
    model: nn.Module,
    dataloader: Iterable[dict[str, Tensor]],
    device: torch.device,
    *,
    n_classes: int,
    precision: str = "fp32",
    progress: bool = True,
    description: str = "Validation",
) -> EvalResult:
    """Score ``model`` (the unwrapped module, never a DDP wrapper) on every batch of ``dataloader``.

    ``description`` labels the progress bar: training validates, ``evaluate.py`` evaluates.

    The model is put in eval mode and its previous mode restored, so BatchNorm buffers are not touched.
    """
    return score_batches(
        model, dataloader, device, n_classes=n_classes, precision=precision, progress=progress, description=description
    ).compute()


@torch.inference_mode()
def score_batches(
    model: nn.Module,
    dataloader: Iterable[dict[str, Tensor]],
    device: torch.device,
    *,
    n_classes: int,
    precision: str = "fp32",
    progress: bool = True,
    description: str = "Validation",
) -> SegmentationMetrics:
    """The accumulated sums of ``evaluate_segmentation``, before scoring (a sharded validation reduces them first)."""
    was_training = model.training
    model.eval()
    metrics = SegmentationMetrics(n_classes=max(n_classes, 2))
    try:
        for batch in tqdm(dataloader, desc=description, unit="batch", leave=False, disable=not progress):
            images = batch["image"].to(device=device, dtype=torch.float32, non_blocking=True)
            true_masks = batch["mask"].to(device=device, dtype=torch.long, non_blocking=True)
            metrics.update(predict_classes(run_model(model, images, precision)).cpu(), true_masks.cpu())
    finally:
        model.train(was_training)
    return metrics


def shard_range(n_items: int, *, rank: int, world_size: int) -> range:
    """The positions of ``n_items`` that ``rank`` scores: contiguous, disjoint, covering each item once (no padding).

    Blocks of ``ceil(n / world_size)``: rank 0 always has an image when there is one (it draws the wandb sample),
    and the last ranks may have none (4 images on 3 ranks: 2, 2, 0).
    """
    block = -(-n_items // world_size)
    start = min(n_items, rank * block)
    return range(start, min(n_items, start + block))


def evaluate(
    net: nn.Module,
    dataloader: Iterable[dict[str, Tensor]],
    device: torch.device | str,
    amp: bool = False,
    *,
    disable_log: bool = False,
) -> float:
    """milesial/Pytorch-UNet's ``evaluate``: the mean foreground Dice of ``net`` over ``dataloader``, as a float.

    Batches are dicts with ``"image"`` and ``"mask"``, as milesial's ``BasicDataset`` gives. ``amp`` runs the forward
    pass in mixed precision (fp16 on CUDA, bf16 elsewhere, like ``train.py --amp``); ``disable_log`` (the documented
    DDP script's flag) hides the progress bar. For per-class Dice and IoU use ``evaluate_segmentation``.
    """
    device = torch.device(device)
    # A DDP wrapper would deadlock when only one rank evaluates: score the module it wraps.
    model = getattr(net, "module", net)
    precision = resolve_precision(None, amp, device.type)
    n_classes = int(getattr(model, "n_classes", 2))
    result = evaluate_segmentation(
        model, dataloader, device, n_classes=n_classes, precision=precision, progress=not disable_log
    )
    return result.dice
