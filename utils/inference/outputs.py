"""Turning predicted class indices back into a mask image with the dataset's original values.

Class ``k`` is written as ``mask_values[k]``, as in milesial/Pytorch-UNet's ``mask_to_image``, so a prediction can be
compared with (or used in place of) the masks the model was trained on:

* ``[0, 1]`` (Carvana) becomes a 1-bit PNG (PIL mode ``'1'``);
* other grey values become an 8-bit ``'L'`` image, or 16-bit ``'I;16'`` when a value does not fit in a byte;
* colour values (``[r, g, b]`` lists, one per class) become an ``'RGB'`` image (``'LA'``/``'RGBA'`` for 2/4 channels).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image

from utils.errors import CheckpointError

# PIL modes for colour masks, by number of channels per value.
_COLOUR_MODES = {2: "LA", 3: "RGB", 4: "RGBA"}
MAX_PNG_GREY_VALUE = 2**16 - 1


def default_mask_values(n_classes: int) -> list[int]:
    """Mask values to use when a checkpoint carries none: ``[0, 1]`` for binary models (milesial's default)."""
    return [0, 1] if n_classes <= 2 else list(range(n_classes))


def check_mask_values(mask_values: Sequence) -> None:
    """Raise ``CheckpointError`` when a grey mask value is too wide for a PNG mask.

    Everything else about a checkpoint's mask values (one per class, unique, integers or colours of 2-4 channels of
    0..255) is checked where the file is read (``utils.checkpoint.model``); ``default_mask_values`` are valid.
    """
    too_wide = [value for value in mask_values if not isinstance(value, Sequence) and value > MAX_PNG_GREY_VALUE]
    if too_wide:
        # Written as they are they would wrap around in the 16-bit PNG: another class's value, silently.
        raise CheckpointError(
            f"the checkpoint's mask value {too_wide[0]} does not fit a 16-bit PNG mask (at most {MAX_PNG_GREY_VALUE}); "
            f"evaluate.py scores this model, but its masks cannot be written as images"
        )


def _value_table(mask_values: Sequence) -> tuple[np.ndarray, str]:
    """A lookup table ``[K]`` or ``[K, channels]`` and the PIL mode to write it with (values checked at reading)."""
    table = np.asarray(mask_values)
    if table.ndim == 2:
        return table.astype(np.uint8), _COLOUR_MODES[table.shape[1]]
    if sorted(table.tolist()) == [0, 1] and len(table) == 2:
        return table.astype(bool), "1"
    if table.max(initial=0) > 255:
        return table.astype(np.uint16), "I;16"
    return table.astype(np.uint8), "L"


def mask_to_image(class_mask: np.ndarray, mask_values: Sequence) -> Image.Image:
    """Map a ``[H, W]`` array of class indices to a PIL image holding ``mask_values[class]`` per pixel (one value
    per class the model predicts: the checkpoint's reader checked that, ``utils.checkpoint.model``)."""
    if class_mask.ndim != 2:
        raise ValueError(f"expected a [H, W] class-index array, got shape {class_mask.shape}")
    table, mode = _value_table(mask_values)
    image = Image.fromarray(table[class_mask])
    # Pillow infers the mode from dtype and shape; make sure it is the one the table promised.
    assert image.mode == mode, (image.mode, mode)
    return image
