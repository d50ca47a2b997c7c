"""One forward pass of prediction: logits under a precision, optionally averaged over flips (``--tta``).

Test-time augmentation as nnU-Net does it in 2D: the image, its horizontal flip, its vertical flip and both, each
flipped back after the model, their logits averaged (4 passes). Whole images and tiles share this function.
"""

from __future__ import annotations

from torch import Tensor, nn

from utils.evaluation import run_model

# Spatial axes of [N, C, H, W] flipped by each test-time pass; () is the image itself.
TTA_FLIPS: tuple[tuple[int, ...], ...] = ((), (3,), (2,), (2, 3))


def forward_logits(model: nn.Module, images: Tensor, precision: str, tta: bool = False) -> Tensor:
    """float32 logits ``[N, K, H, W]`` of ``images``; with ``tta`` the mean over ``TTA_FLIPS``."""
    if not tta:
        return run_model(model, images, precision)
    total: Tensor | None = None
    for dims in TTA_FLIPS:
        flipped = images.flip(dims) if dims else images
        logits = run_model(model, flipped, precision)
        logits = logits.flip(dims) if dims else logits
        total = logits if total is None else total.add_(logits)
    assert total is not None
    return total / len(TTA_FLIPS)
