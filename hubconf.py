"""torch.hub entry point, for local checkouts only:

    model = torch.hub.load("/path/to/unet-ddp", "unet", source="local", n_classes=2, checkpoint="best.pth")

Weights come only from a local file; this entry point never downloads anything.
"""

from __future__ import annotations

from pathlib import Path

dependencies = ["torch"]


def unet(
    n_channels: int | None = None,
    n_classes: int | None = None,
    bilinear: bool | None = None,
    base_channels: int | None = None,
    checkpoint: str | Path | None = None,
    pretrained: bool = False,
):
    """A UNet; with ``checkpoint`` (a local file path) its weights and stored architecture are loaded.

    Without a checkpoint, unset arguments take ``unet.UNetArgs``'s defaults (3 channels, 2 classes, transposed
    convolutions, width 64). With one, the file decides the architecture, and an argument given here that contradicts
    it is an error (``utils.model_spec``, the policy of predict.py and train.py). The returned model then carries
    ``spec`` (the ``ModelSpec``), ``mask_values`` and ``scale`` (the training scale; 0.5 for files that do not record
    it), so images can be prepared as predict.py does. ``pretrained=True`` is refused: there are no weights to
    download.
    """
    # Imported here: torch.hub puts the checkout on sys.path only while it imports this file.
    from unet import UNet, UNetArgs
    from utils.errors import CheckpointError
    from utils.model_spec import load_model

    if pretrained:
        raise CheckpointError("unet-ddp publishes no pretrained weights to download; pass checkpoint=<local file>")
    expected = {"n_channels": n_channels, "n_classes": n_classes, "bilinear": bilinear, "base_channels": base_channels}
    if checkpoint is None:
        return UNet(**UNetArgs(**{key: value for key, value in expected.items() if value is not None}).as_dict())
    if "://" in str(checkpoint):
        raise CheckpointError(f"checkpoint={checkpoint!r}: only local files are loaded, never URLs; download it first")
    model, spec = load_model(Path(checkpoint), expected=expected, source="checkpoint=")
    # Keep how the checkpoint's images were prepared with the model: the class-to-value mapping (to write masks with
    # the original values) and the training scale (0.5, milesial's default, for files that do not record it).
    model.spec = spec
    model.mask_values = spec.mask_values
    model.scale = spec.scale
    return model
