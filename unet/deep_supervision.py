"""Deep supervision (nnU-Net): extra logits from the decoder stages at 1/2 and 1/4 of the input resolution.

The heads are 1x1 convolutions used only by training-mode forward passes, which then return
``[logits, logits at 1/2, logits at 1/4]``; every such pass uses every head, so DistributedDataParallel finds no
unused parameters. Evaluation-mode passes (validation, predict, evaluate, export) return the full-resolution logits
alone, exactly what a model without heads returns. The loss side is ``utils.training.objective.deep_supervision_loss``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

# Downsampling factor of each auxiliary output, in the order models return them.
AUX_FACTORS = (2, 4)


class AuxiliaryHeads(nn.Module):
    """One 1x1 convolution to ``n_classes`` logits per decoder feature, cropped to the input's extent."""

    def __init__(self, in_channels: Sequence[int], n_classes: int) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(channels, n_classes, kernel_size=1) for channels in in_channels)

    def forward(self, features: Sequence[torch.Tensor], height: int, width: int) -> list[torch.Tensor]:
        """Logits of ``features`` (at 1/2 and 1/4 of a possibly padded input), cropped to the unpadded input's part."""
        outputs = []
        for conv, feature, factor in zip(self.convs, features, AUX_FACTORS, strict=True):
            # Ceil division: the rows that still hold some of the input (padding, if any, lies at the bottom/right).
            outputs.append(conv(feature)[..., : -(-height // factor), : -(-width // factor)])
        return outputs
