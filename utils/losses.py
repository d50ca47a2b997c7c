"""The training loss: cross-entropy + Dice for 2+ classes, BCE + Dice for one class (milesial/Pytorch-UNet's recipe).

One difference from milesial: the Dice term is computed per image and averaged (``reduce_batch_first=False``)
instead of over the batch as one volume. A per-image mean decomposes over data-parallel ranks with equal batch sizes
(the DDP gradient average of the ranks' losses equals the gradient of the loss of the global batch), so N processes
with batch b train exactly like one process with batch N*b. A batch-volume Dice does not decompose: its ratio of sums
would depend on how the global batch is split.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from .dice_score import dice_coeff, multiclass_dice_coeff


def segmentation_loss(logits: Tensor, masks: Tensor, n_classes: int) -> Tensor:
    """Loss of ``[B, C, H, W]`` logits against ``[B, H, W]`` class indices; a mean over images and pixels."""
    if n_classes == 1:
        binary_logits = logits[:, 0].float()
        target = masks.float()
        bce = F.binary_cross_entropy_with_logits(binary_logits, target)
        return bce + 1 - dice_coeff(binary_logits.sigmoid(), target, reduce_batch_first=False)
    logits = logits.float()
    cross_entropy = F.cross_entropy(logits, masks)
    probabilities = logits.softmax(dim=1)
    one_hot = F.one_hot(masks, n_classes).permute(0, 3, 1, 2).to(probabilities.dtype)
    return cross_entropy + 1 - multiclass_dice_coeff(probabilities, one_hot, reduce_batch_first=False)
