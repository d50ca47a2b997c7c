"""torch.hub entry points, for local checkouts only:

    model = torch.hub.load("/path/to/unet-ddp", "unet", source="local", n_classes=2, checkpoint="best.pth")
    model = torch.hub.load("/path/to/unet-ddp", "unet_carvana", source="local")  # milesial's entry point

Weights come only from a local file; these entry points never download anything. Models are returned in eval mode
(ready for inference; call ``.train()`` to fine-tune).
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
    """A UNet in eval mode; with ``checkpoint`` (a local file path) its weights and stored architecture are loaded.

    Without a checkpoint, unset arguments take ``unet.UNetArgs``'s defaults (3 channels, 2 classes, transposed
    convolutions, width 64). With one, the file decides the architecture, and an argument given here that contradicts
    it is an error (``utils.checkpoint.model``, the policy of predict.py and train.py). The returned model then carries
    ``spec`` (the ``ModelSpec``), ``mask_values`` and ``scale`` (the training scale; 0.5 for files that do not record
    it), so images can be prepared as predict.py does. ``pretrained=True`` is refused: there are no weights to
    download.
    """
    # Imported here: torch.hub puts the checkout on sys.path only while it imports this file.
    from unet import build_model
    from utils.checkpoint.model import load_model
    from utils.errors import CheckpointError

    if pretrained:
        raise CheckpointError("unet-ddp publishes no pretrained weights to download; pass checkpoint=<local file>")
    expected = {"n_channels": n_channels, "n_classes": n_classes, "bilinear": bilinear, "base_channels": base_channels}
    if checkpoint is None:
        return build_model({key: value for key, value in expected.items() if value is not None}).eval()
    if "://" in str(checkpoint):
        raise CheckpointError(f"checkpoint={checkpoint!r}: only local files are loaded, never URLs; download it first")
    model, spec = load_model(Path(checkpoint), expected=expected, source="checkpoint=")
    # Keep how the checkpoint's images were prepared with the model: the class-to-value mapping (to write masks with
    # the original values) and the training scale (0.5, milesial's default, for files that do not record it).
    model.spec = spec
    model.mask_values = spec.mask_values
    model.scale = spec.scale
    return model.eval()


def unet_carvana(pretrained: bool = False, scale: float = 0.5):
    """milesial/Pytorch-UNet's entry point: its Carvana architecture (3 channels, 2 classes, transposed convolutions),
    untrained, in eval mode; ``scale`` (the image scale its weights were trained at) is kept as ``model.scale``.

    ``pretrained=True`` is refused in one line: weights come from a local file, loaded with the ``unet`` entry point.
    """
    from utils.errors import CheckpointError

    if pretrained:
        raise CheckpointError(
            "unet_carvana(pretrained=True): unet-ddp downloads no weights; they come from a local file: "
            "torch.hub.load(<this checkout>, 'unet', source='local', checkpoint='<file>.pth') (milesial's released "
            "unet_carvana .pth files load too, once downloaded)"
        )
    model = unet(n_channels=3, n_classes=2, bilinear=False, base_channels=64)
    model.scale = scale
    return model
