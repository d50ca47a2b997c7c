"""A checkpoint checked against itself before any model is built from it.

A file's ``model_args`` say which model to build; its weights say which model they belong to. Trusting the first
alone lets a damaged or crafted file make the process allocate a model of tens of GB (``base_channels=1024``) before
the weights are found not to fit. So before building:

* the arguments are compared with the weights' shapes on the meta device (no memory is allocated);
* the weights are floating point (integer weights give an all-background mask that looks like a result), and every
  BatchNorm ``running_var`` is non-negative (a negative variance is the square root of a negative number: NaN);
* the mask values are one per class, unique, and integers (grey values) or colours of 2-4 channels of 0..255, so
  each predicted class maps to one value of the output image.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from unet import build_model
from utils.errors import CheckpointError

# Grey mask values are written to PNG (16 bits at most) by predict: utils.inference.outputs.
MAX_GREY_MASK_VALUE = 2**32 - 1
"""The widest grey value a mask file can hold (32-bit masks train); predict refuses more than PNG's 16 bits."""
_COLOUR_CHANNELS = (2, 3, 4)


def check_weights_match_args(model_args: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor], path: Any) -> None:
    """Refuse ``model_args`` that describe another model than ``state_dict``'s weights (compared on the meta device)."""
    with torch.device("meta"):
        expected = build_model(dict(model_args)).state_dict()
    missing = [key for key in expected if key not in state_dict]
    unexpected = [key for key in state_dict if key not in expected]
    mismatched = [key for key in expected if key in state_dict and expected[key].shape != state_dict[key].shape]
    if not (missing or unexpected or mismatched):
        return
    if mismatched:
        key = mismatched[0]
        detail = (
            f"{key} has shape {tuple(state_dict[key].shape)} in the weights but {tuple(expected[key].shape)} in the "
            f"model its model_args describe"
        )
    elif missing:
        detail = f"the model its model_args describe has {key_count(missing)} the weights lack (e.g. {missing[0]})"
    else:
        detail = f"the weights hold {key_count(unexpected)} that model lacks (e.g. {unexpected[0]})"
    raise CheckpointError(
        f"checkpoint {path} contradicts itself: its model_args {dict(model_args)} do not describe its weights "
        f"({detail}); the file is damaged or was edited, use another checkpoint"
    )


def key_count(keys: Sequence[str]) -> str:
    return f"{len(keys)} tensor{'s' if len(keys) != 1 else ''}"


def check_weight_values(state_dict: Mapping[str, torch.Tensor], path: Any) -> None:
    """Floating-point weights, and non-negative BatchNorm variances."""
    for key, tensor in state_dict.items():
        if key.endswith("num_batches_tracked"):
            continue  # BatchNorm's step counter is an integer by design
        if not tensor.is_floating_point():
            raise CheckpointError(
                f"checkpoint {path} holds {key} as {tensor.dtype}, not floating point: such weights cannot have been "
                f"trained; the file is damaged or was converted wrongly, use another checkpoint"
            )
        if key.endswith("running_var") and tensor.numel() and bool((tensor < 0).any()):
            raise CheckpointError(
                f"checkpoint {path} holds a negative BatchNorm variance in {key} (min {float(tensor.min()):g}), which "
                f"no training produces; the file is damaged, use another checkpoint"
            )


def check_mask_values_of(mask_values: Any, n_classes: int, path: Any) -> None:
    """``mask_values``: one unique integer (or colour) per predicted class; None (not recorded) passes."""
    if mask_values is None:
        return
    n_predicted = 2 if n_classes == 1 else n_classes
    where = f"checkpoint {path}: mask_values {_short(mask_values)}"
    if not isinstance(mask_values, list | tuple):
        raise CheckpointError(f"{where} are not a list; the file is damaged, use another checkpoint")
    if len(mask_values) != n_predicted:
        raise CheckpointError(
            f"{where} name {len(mask_values)} values but the model predicts {n_predicted} classes (one value per "
            f"class); the file is damaged or was edited, use another checkpoint"
        )
    keys = [_mask_value_key(value, where) for value in mask_values]
    colours = {len(key) for key in keys if isinstance(key, tuple)}
    if colours and (len(colours) != 1 or any(not isinstance(key, tuple) for key in keys)):
        raise CheckpointError(f"{where} mix grey values and colours, or colours of different lengths")
    if len(set(keys)) != len(keys):
        raise CheckpointError(
            f"{where} repeat a value, so two classes would be written the same; the file is damaged, use another "
            f"checkpoint"
        )


def _mask_value_key(value: Any, where: str) -> int | tuple[int, ...]:
    if isinstance(value, list | tuple):
        if len(value) not in _COLOUR_CHANNELS or not all(_is_integer(part, 255) for part in value):
            raise CheckpointError(f"{where} hold {value!r}, not a colour of 2-4 integers in 0..255")
        return tuple(int(part) for part in value)
    if not _is_integer(value, MAX_GREY_MASK_VALUE):
        raise CheckpointError(f"{where} hold {value!r}, not an integer in 0..{MAX_GREY_MASK_VALUE} (or a colour)")
    return int(value)


def _is_integer(value: Any, high: int) -> bool:
    if isinstance(value, bool):
        return True  # milesial's 1-bit masks give [False, True]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return isinstance(value, int) and 0 <= value <= high


def _short(values: Any) -> str:
    text = repr(list(values) if isinstance(values, tuple) else values)
    return text if len(text) <= 80 else text[:77] + "..."


def check_checkpoint(
    model_args: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor], mask_values: Any, path: str | Path
) -> None:
    """Every check of this module; the arguments must already be valid (``validate_model_args``).

    The arguments against the weights first: the other checks read the class count from the arguments.
    """
    check_weights_match_args(model_args, state_dict, path)
    check_weight_values(state_dict, path)
    check_mask_values_of(mask_values, int(model_args["n_classes"]), path)
