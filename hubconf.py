"""torch.hub entry point, for local checkouts only:

    model = torch.hub.load("/path/to/unet-ddp", "unet", source="local", n_classes=2, checkpoint="best.pth")

Weights come only from a local file; this entry point never downloads anything.
"""

from __future__ import annotations

import logging
from pathlib import Path

dependencies = ["torch"]

logger = logging.getLogger(__name__)


def unet(
    n_channels: int = 3,
    n_classes: int = 2,
    bilinear: bool = False,
    base_channels: int = 64,
    checkpoint: str | Path | None = None,
    pretrained: bool = False,
):
    """A UNet; with ``checkpoint`` (a local file path) its weights and stored architecture are loaded.

    A checkpoint that stores its model arguments decides the architecture; arguments given here that differ are
    reported in a warning. ``pretrained=True`` is refused: there are no downloadable weights.
    """
    # Imported here: torch.hub puts the checkout on sys.path only while it imports this file.
    from unet import UNet
    from utils.checkpoint import build_model_from_checkpoint
    from utils.errors import CheckpointError

    if pretrained:
        raise CheckpointError("unet-ddp publishes no pretrained weights to download; pass checkpoint=<local file>")
    if checkpoint is None:
        return UNet(n_channels, n_classes, bilinear=bilinear, base_channels=base_channels)
    if "://" in str(checkpoint):
        raise CheckpointError(f"checkpoint={checkpoint!r}: only local files are loaded, never URLs; download it first")
    model, mask_values = build_model_from_checkpoint(Path(checkpoint))
    requested = {"n_channels": n_channels, "n_classes": n_classes, "bilinear": bilinear, "base_channels": base_channels}
    differing = {name: value for name, value in model.constructor_args().items() if requested[name] != value}
    if differing:
        logger.warning("%s was trained with %s; using those instead of the arguments given", checkpoint, differing)
    # Keep the class-to-value mapping with the model so callers can write masks with the original values.
    model.mask_values = mask_values
    return model
