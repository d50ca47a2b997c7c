"""Dice and IoU: the soft Dice of the training loss, the count-based scores of validation, and scoring over a loader.

The soft Dice functions (``dice_coeff``, ``multiclass_dice_coeff``, ``dice_loss``) keep milesial/Pytorch-UNet's
signatures and semantics; ``utils.dice_score`` re-exports them under milesial's import path. Evaluation builds on
per-image, per-class true-positive / false-positive / false-negative counts (``confusion_counts``), so a score is
always within [0, 1].

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
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from tqdm import tqdm

from utils.hardware import autocast, resolve_precision


def dice_coeff(input: Tensor, target: Tensor, reduce_batch_first: bool = False, epsilon: float = 1e-6) -> Tensor:
    """Soft Dice of ``input`` against ``target`` (same shape, values in [0, 1]).

    With ``reduce_batch_first`` a ``[B, H, W]`` batch counts as one volume; otherwise each ``[H, W]`` map gets its own
    Dice and the mean is returned. Two empty maps score 1.
    """
    if input.size() != target.size():
        raise ValueError(f"dice_coeff: input {tuple(input.shape)} and target {tuple(target.shape)} differ in shape")
    if reduce_batch_first and input.dim() != 3:
        raise ValueError("dice_coeff: reduce_batch_first needs a [B, H, W] input")
    sum_dim = (-1, -2, -3) if reduce_batch_first else (-1, -2)
    intersection = 2 * (input * target).sum(dim=sum_dim)
    sets_sum = input.sum(dim=sum_dim) + target.sum(dim=sum_dim)
    # Both maps empty: the intersection (0) replaces the sum so the ratio becomes epsilon / epsilon = 1.
    sets_sum = torch.where(sets_sum == 0, intersection, sets_sum)
    return ((intersection + epsilon) / (sets_sum + epsilon)).mean()


def multiclass_dice_coeff(
    input: Tensor, target: Tensor, reduce_batch_first: bool = False, epsilon: float = 1e-6
) -> Tensor:
    """Mean soft Dice over the classes of one-hot ``[B, C, H, W]`` tensors."""
    return dice_coeff(input.flatten(0, 1), target.flatten(0, 1), reduce_batch_first, epsilon)


def dice_loss(input: Tensor, target: Tensor, multiclass: bool = False) -> Tensor:
    """``1 - Dice`` over the whole batch: the Dice term of the training loss."""
    score = multiclass_dice_coeff if multiclass else dice_coeff
    return 1 - score(input, target, reduce_batch_first=True)


def confusion_counts(pred: Tensor, target: Tensor, n_classes: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-image, per-class true-positive, false-positive and false-negative pixel counts.

    ``pred`` and ``target`` are ``[B, H, W]`` class indices in ``0..n_classes-1``; each result is ``[B, n_classes]``
    (float64, exact for any image size that fits in memory). Pixels whose target is negative (void,
    ``IGNORE_INDEX``) are counted nowhere, whatever was predicted there.
    """
    if pred.shape != target.shape or pred.dim() != 3:
        raise ValueError(
            f"confusion_counts needs two [B, H, W] tensors, got {tuple(pred.shape)}, {tuple(target.shape)}"
        )
    batch = pred.shape[0]
    # Encode (truth, prediction) pairs as one index and count them with bincount: one pass, no one-hot tensors.
    target, pred = target.reshape(batch, -1).long().cpu(), pred.reshape(batch, -1).long().cpu()
    # Void pixels go to one extra bin per image, dropped below.
    bins = n_classes * n_classes + 1
    pair = torch.where(target >= 0, target * n_classes + pred, bins - 1)
    offsets = torch.arange(batch).unsqueeze(1) * bins
    confusion = torch.bincount((pair + offsets).flatten(), minlength=batch * bins)
    confusion = confusion.reshape(batch, bins)[:, :-1].reshape(batch, n_classes, n_classes).double()
    true_pos = confusion.diagonal(dim1=1, dim2=2)
    false_pos = confusion.sum(dim=1) - true_pos
    false_neg = confusion.sum(dim=2) - true_pos
    return true_pos, false_pos, false_neg


def dice_from_counts(true_pos: Tensor, false_pos: Tensor, false_neg: Tensor) -> Tensor:
    """Dice = 2TP / (2TP + FP + FN), elementwise; 1 where the class is absent from prediction and truth."""
    denominator = 2 * true_pos + false_pos + false_neg
    return torch.where(denominator > 0, 2 * true_pos / denominator.clamp_min(1), torch.ones_like(denominator))


def iou_from_counts(true_pos: Tensor, false_pos: Tensor, false_neg: Tensor) -> Tensor:
    """IoU = TP / (TP + FP + FN), elementwise; 1 where the class is absent from prediction and truth."""
    denominator = true_pos + false_pos + false_neg
    return torch.where(denominator > 0, true_pos / denominator.clamp_min(1), torch.ones_like(denominator))


@dataclass
class EvalResult:
    """Scores over a dataset; per-class lists are indexed by class (0 = background)."""

    per_class_dice: list[float]
    per_class_iou: list[float]
    n_images: int
    micro_per_class_dice: list[float]
    """Per class, from the pixel counts summed over the dataset (the micro reduction)."""
    micro_per_class_iou: list[float]

    @property
    def dice(self) -> float:
        """The headline: the macro Dice averaged over the foreground classes."""
        return self.reductions()["macro"]["dice"]

    @property
    def iou(self) -> float:
        return self.reductions()["macro"]["iou"]

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


class SegmentationMetrics:
    """Accumulates per-image Dice and IoU per class; ``n_classes`` counts background (2 for binary models)."""

    def __init__(self, n_classes: int) -> None:
        self.n_classes = n_classes
        # Per class, summed over images: the Dice, the IoU, then true positives, false positives, false negatives,
        # and the images themselves (their count, in every column).
        self._sums = torch.zeros(6, n_classes, dtype=torch.float64)

    def update(self, pred: Tensor, target: Tensor) -> None:
        """Add a ``[B, H, W]`` batch of predicted and true class indices."""
        counts = confusion_counts(pred, target, self.n_classes)
        per_image = [dice_from_counts(*counts), iou_from_counts(*counts), *counts, torch.ones_like(counts[0])]
        self._sums += torch.stack([values.sum(dim=0) for values in per_image])

    def reduce(self, reduce_sums: Callable[[Tensor], Tensor]) -> None:
        """Replace the sums by ``reduce_sums`` of them (the sum over ranks): one float64 tensor, one collective."""
        self._sums = reduce_sums(self._sums).cpu()

    def compute(self) -> EvalResult:
        dice_sum, iou_sum, *counts_sum, images = self._sums
        n_images = int(images[0])  # a float64 count: exact
        if n_images == 0:
            raise ValueError("no images were evaluated: the validation set is empty")
        return EvalResult(
            per_class_dice=(dice_sum / n_images).tolist(),
            per_class_iou=(iou_sum / n_images).tolist(),
            n_images=n_images,
            micro_per_class_dice=dice_from_counts(*counts_sum).tolist(),
            micro_per_class_iou=iou_from_counts(*counts_sum).tolist(),
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
    """Score ``model`` (the unwrapped module, never a DDP wrapper) on every batch of ``dataloader``: the sums, before
    scoring (a sharded validation reduces them first). ``description`` labels the progress bar: training validates,
    ``evaluate.py`` evaluates.

    The model is put in eval mode and its previous mode restored, so BatchNorm buffers are not touched.
    """
    was_training = model.training
    model.eval()
    metrics = SegmentationMetrics(n_classes=max(n_classes, 2))
    try:
        for batch in tqdm(dataloader, desc=description, unit="batch", leave=False, disable=not progress):
            images = batch["image"].to(device=device, dtype=torch.float32, non_blocking=True)
            # The masks stay on the CPU, where the counting happens.
            metrics.update(predict_classes(run_model(model, images, precision)).cpu(), batch["mask"])
    finally:
        model.train(was_training)
    return metrics


def evaluate_segmentation(
    model: nn.Module, dataloader: Iterable[dict[str, Tensor]], device: torch.device, **options: Any
) -> EvalResult:
    """The ``EvalResult`` of ``score_batches`` (same arguments)."""
    return score_batches(model, dataloader, device, **options).compute()


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
