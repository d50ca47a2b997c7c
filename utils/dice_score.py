"""milesial/Pytorch-UNet's import path for the Dice maths: ``from utils.dice_score import dice_loss``.

Only re-exports of milesial's three functions, for code written against milesial's layout; the project itself, and
the count-based scores (``confusion_counts``, ``dice_from_counts``, ``iou_from_counts``), live in ``utils.evaluation``.
"""

from utils.evaluation import dice_coeff, dice_loss, multiclass_dice_coeff

__all__ = ["dice_coeff", "dice_loss", "multiclass_dice_coeff"]
