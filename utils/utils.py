"""milesial/Pytorch-UNet's ``utils.utils``: ``plot_img_and_mask``, which its ``predict.py --viz`` calls.

Headless-safe: without a display (no ``DISPLAY``/``WAYLAND_DISPLAY`` on Linux, or a non-interactive matplotlib
backend such as ``MPLBACKEND=Agg``) the figure is drawn on matplotlib's Agg canvas, not shown, and returned, with one
log line saying so; nothing needs a window system. With a display it is shown as milesial's version does.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["plot_img_and_mask"]

NON_INTERACTIVE_BACKENDS = frozenset({"agg", "pdf", "ps", "svg", "cairo", "pgf", "template"})


def plot_img_and_mask(img: Any, mask: Any) -> Any:
    """The image beside one panel per class of ``mask``; returns the matplotlib ``Figure``.

    ``mask``: class indices ``[H, W]`` (milesial's current ``predict_img``; a boolean mask is classes 0 and 1) or one
    plane per class ``[C, H, W]`` (its older one-hot output).
    """
    mask = np.asarray(mask)
    if mask.ndim not in (2, 3):
        raise ValueError(f"plot_img_and_mask: mask must be [H, W] class indices or [C, H, W] planes, got {mask.shape}")
    classes = max(int(mask.max()) + 1, 2) if mask.size else 2
    planes = list(mask) if mask.ndim == 3 else [mask == index for index in range(classes)]
    show = _can_show()
    if show:
        import matplotlib.pyplot as plt

        figure = plt.figure()
    else:
        from matplotlib.figure import Figure

        figure = Figure()  # made without pyplot, it draws on the Agg canvas and touches no window system
    axes = figure.subplots(1, len(planes) + 1, squeeze=False)[0]
    titles = ["Input image", *(f"Mask (class {index})" for index in range(len(planes)))]
    for each, title, picture in zip(axes, titles, [img, *planes], strict=True):
        each.set_title(title)
        each.imshow(picture)
        each.set_xticks([])
        each.set_yticks([])
    if show:
        plt.show()
    else:
        logger.info(
            "No display: the image and mask figure is not shown (plot_img_and_mask returns it; .savefig saves it)"
        )
    return figure


def _can_show() -> bool:
    """Whether a window can open: an interactive backend asked for (or none), and on Linux a display to put it on.

    Where matplotlib then finds no GUI toolkit it falls back to Agg itself, and ``show`` only warns.
    """
    if os.environ.get("MPLBACKEND", "").lower() in NON_INTERACTIVE_BACKENDS:
        return False
    return not sys.platform.startswith("linux") or bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
