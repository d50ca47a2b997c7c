"""Prediction overlays written as images (``predict.py --viz``), with the true mask beside them when one is given.

Class 0 is treated as background and left undrawn; the other classes are painted over the image in their own colour:
the dataset's colour when its mask values are colours, else a fixed palette.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch import Tensor
from torchvision.utils import draw_segmentation_masks

from utils.data_loading import BasicDataset, load_image

logger = logging.getLogger(__name__)

# Distinct, saturated colours for grey-valued masks (class 1 first).
PALETTE = [
    (255, 64, 64),
    (64, 200, 64),
    (64, 128, 255),
    (255, 200, 0),
    (200, 64, 255),
    (0, 220, 220),
    (255, 128, 0),
    (255, 0, 160),
]
OVERLAY_ALPHA = 0.5
GAP_PIXELS = 8
# Truth masks are looked up by the image's name plus one of these suffixes (Carvana uses "_mask").
TRUTH_SUFFIXES = ("", "_mask", "_masks", "-mask", "_label", "_labels", "_gt")
MASK_FILE_SUFFIXES = (".png", ".gif", ".bmp", ".tif", ".tiff", ".jpg", ".jpeg", ".npy", ".pt")


def class_colours(mask_values: Sequence, n_classes: int) -> list[tuple[int, int, int]]:
    """One RGB colour per class (index 0, background, included for indexing but never drawn)."""
    if mask_values and all(isinstance(value, Sequence) and len(value) >= 3 for value in mask_values):
        return [tuple(int(channel) for channel in value[:3]) for value in mask_values]
    count = max(n_classes, 2)
    return [(0, 0, 0)] + [PALETTE[(k - 1) % len(PALETTE)] for k in range(1, count)]


def to_rgb(image: Tensor) -> Tensor:
    """``[C, H, W]`` uint8 with any channel count to 3 channels for display."""
    if image.shape[0] >= 3:
        return image[:3]
    return image[:1].expand(3, -1, -1)


def overlay(image: Tensor, classes: np.ndarray, colours: Sequence[tuple[int, int, int]]) -> Tensor:
    """Paint every non-background class of ``classes`` ``[H, W]`` over ``image`` ``[C, H, W]`` uint8."""
    rgb = to_rgb(image).contiguous()
    class_map = torch.from_numpy(np.asarray(classes, dtype=np.int64))
    present = [k for k in torch.unique(class_map).tolist() if k != 0]
    if not present:
        return rgb.clone()
    masks = torch.stack([class_map == k for k in present])
    return draw_segmentation_masks(rgb, masks, alpha=OVERLAY_ALPHA, colors=[colours[k] for k in present])


def side_by_side(left: Tensor, right: Tensor, labels: tuple[str, str] = ("truth", "prediction")) -> Image.Image:
    """Two ``[3, H, W]`` uint8 images next to each other with a white gap and a label in each corner."""
    gap = torch.full((3, left.shape[1], GAP_PIXELS), 255, dtype=torch.uint8)
    joined = Image.fromarray(torch.cat([left, gap, right], dim=2).permute(1, 2, 0).numpy())
    draw = ImageDraw.Draw(joined)
    for x, label in ((2, labels[0]), (left.shape[2] + GAP_PIXELS + 2, labels[1])):
        draw.text((x + 1, 3), label, fill=(0, 0, 0))
        draw.text((x, 2), label, fill=(255, 255, 255))
    return joined


def find_truth_mask(masks_dir: Path, image_path: Path) -> Path | None:
    """The mask in ``masks_dir`` named like ``image_path`` (``car.jpg`` -> ``car.png``, ``car_mask.gif``, ...)."""
    for suffix in TRUTH_SUFFIXES:
        for extension in MASK_FILE_SUFFIXES:
            candidate = masks_dir / f"{image_path.stem}{suffix}{extension}"
            if candidate.is_file():
                return candidate
    return None


def load_truth_classes(mask_path: Path, mask_values: Sequence, size: tuple[int, int]) -> np.ndarray:
    """Class indices ``[H, W]`` of a true mask, resized (nearest) to ``size`` = ``(H, W)`` if it differs."""
    mask_image = load_image(mask_path)
    if (mask_image.height, mask_image.width) != size:
        logger.warning(
            "truth mask %s is %dx%d, image is %dx%d; resizing the mask for display",
            mask_path,
            mask_image.width,
            mask_image.height,
            size[1],
            size[0],
        )
        mask_image = mask_image.resize((size[1], size[0]), Image.NEAREST)
    return np.asarray(BasicDataset.preprocess(list(mask_values), mask_image, 1.0, is_mask=True), dtype=np.int64)


def render_visualization(
    image: Tensor,
    predicted: np.ndarray,
    colours: Sequence[tuple[int, int, int]],
    truth: np.ndarray | None = None,
) -> Image.Image:
    """The prediction overlay alone, or truth | prediction side by side when ``truth`` is given."""
    predicted_overlay = overlay(image, predicted, colours)
    if truth is None:
        return Image.fromarray(predicted_overlay.permute(1, 2, 0).numpy())
    return side_by_side(overlay(image, truth, colours), predicted_overlay)
