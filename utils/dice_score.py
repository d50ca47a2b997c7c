"""Dice and IoU: the soft Dice used as a training loss, and count-based metrics used for evaluation.

The training functions keep milesial/Pytorch-UNet's signatures and semantics. Evaluation builds on per-image,
per-class true-positive / false-positive / false-negative counts, so a score is always within [0, 1], a class that is
absent from both prediction and truth scores 1, and the dataset score is a mean over images that does not depend on
how images were grouped into batches.
"""

from __future__ import annotations

import torch
from torch import Tensor


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
