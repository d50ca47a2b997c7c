"""milesial/Pytorch-UNet's import path for the Dice maths: ``from utils.dice_score import dice_loss``.

Only re-exports, for code written against milesial's layout; the project itself imports from ``utils.evaluation``.
"""

from utils.evaluation import (
    confusion_counts,
    dice_coeff,
    dice_from_counts,
    dice_loss,
    iou_from_counts,
    multiclass_dice_coeff,
)

__all__ = [
    "confusion_counts",
    "dice_coeff",
    "dice_from_counts",
    "dice_loss",
    "iou_from_counts",
    "multiclass_dice_coeff",
]
