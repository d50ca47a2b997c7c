"""The model a checkpoint describes: its UNet arguments and mask values, checked once, for every caller.

Training (``--load``, ``--resume``), ``predict.py``, ``evaluate.py`` and ``hubconf.py`` all build models from files
through this module, with one policy: the file decides the architecture, and a flag (or argument) that contradicts
it is an error that names the flag. Files that store no arguments (milesial/Pytorch-UNet's, the documented DDP
script's) have them inferred from the shapes of their weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from unet import UNet
from utils.checkpoint import LoadedWeights, load_state_dict_checked, read_model_weights
from utils.errors import CheckpointError

# How a user sets each constructor argument; the image channels come from the data, not from a flag.
ARG_FLAGS = {
    "n_channels": "image channels",
    "n_classes": "--classes",
    "bilinear": "--bilinear",
    "base_channels": "--base-channels",
}
# Sane ranges: a crafted file must not make the process allocate gigabytes before anything else is checked.
_INT_RANGES = {"n_channels": (1, 64), "n_classes": (1, 1024), "base_channels": (1, 1024)}


@dataclass(frozen=True)
class ModelSpec:
    """What builds a model from a checkpoint: UNet's constructor arguments and the mask value of each class."""

    n_channels: int
    n_classes: int
    bilinear: bool
    base_channels: int
    mask_values: list | None = None

    @property
    def model_args(self) -> dict[str, Any]:
        return {
            "n_channels": self.n_channels,
            "n_classes": self.n_classes,
            "bilinear": self.bilinear,
            "base_channels": self.base_channels,
        }

    def build(self) -> UNet:
        return UNet(**self.model_args)


def validate_model_args(args: Any, path: str | Path) -> dict[str, Any]:
    """``args`` as read from ``path``, checked for known keys, types and ranges before any model is allocated."""
    if not isinstance(args, Mapping):
        raise CheckpointError(f"{path}: model_args is a {type(args).__name__}, not a mapping; the file is damaged")
    unknown = sorted(set(args) - set(ARG_FLAGS))
    missing = sorted(set(ARG_FLAGS) - set(args))
    if unknown or missing:
        problem = f"unknown keys {unknown}" if unknown else f"missing keys {missing}"
        raise CheckpointError(f"{path}: model_args has {problem}; it was not written by a compatible unet-ddp")
    for key, (low, high) in _INT_RANGES.items():
        value = args[key]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise CheckpointError(f"{path}: model_args {key}={value!r} is not an integer in [{low}, {high}]")
    if not isinstance(args["bilinear"], bool):
        raise CheckpointError(f"{path}: model_args bilinear={args['bilinear']!r} is not true or false")
    return dict(args)


def infer_model_args(state_dict: Mapping[str, torch.Tensor], path: str | Path) -> dict[str, Any]:
    """UNet's constructor arguments recovered from the shapes of its weights (for files that do not store them)."""
    try:
        first_conv = state_dict["inc.double_conv.0.weight"]
        out_conv = state_dict["outc.conv.weight"]
    except KeyError as error:
        raise CheckpointError(f"{path}: the weights are not a UNet's (key {error.args[0]!r} is missing)") from error
    return {
        "n_channels": int(first_conv.shape[1]),
        "n_classes": int(out_conv.shape[0]),
        # Only the transposed-convolution variant has weights in its upsampling layers.
        "bilinear": "up1.up.weight" not in state_dict,
        "base_channels": int(first_conv.shape[0]),
    }


def spec_of(loaded: LoadedWeights, path: str | Path) -> ModelSpec:
    """The model ``loaded`` (read from ``path``) describes."""
    if loaded.model_args is not None:
        args = validate_model_args(loaded.model_args, path)
    else:
        args = validate_model_args(infer_model_args(loaded.state_dict, path), path)
    return ModelSpec(**args, mask_values=loaded.mask_values)


def check_expected(
    spec: ModelSpec, expected: Mapping[str, Any], path: str | Path, *, source: str, images_from: str = "the input"
) -> None:
    """Refuse ``spec`` when it contradicts ``expected`` (arguments set by flags; None = not set).

    ``source`` names the flag the file came from (``--load``, ``--model``, ...), ``images_from`` where the images
    whose channel count is ``expected["n_channels"]`` come from (``--imgs``, ...).
    """
    stored = spec.model_args
    for key, value in expected.items():
        if value is None or stored[key] == value:
            continue
        if key == "n_channels":
            raise CheckpointError(
                f"{source} {path} expects {stored[key]}-channel images but the images in {images_from} have {value} "
                f"channels; use a "
                f"checkpoint trained on such images"
            )
        flag = ARG_FLAGS[key]
        if key == "bilinear":
            fix = "pass --bilinear" if stored[key] else "drop --bilinear"
        else:
            fix = f"pass {flag} {stored[key]}"
        raise CheckpointError(
            f"{source} {path} was trained with {key}={stored[key]!r} but {flag} asks for {value!r}; {fix} or use a "
            f"matching checkpoint"
        )


def load_weights_into(model: UNet, loaded: LoadedWeights, path: str | Path) -> None:
    """Copy ``loaded``'s weights into ``model``, with a message naming the keys or shapes that differ."""
    load_state_dict_checked(model, loaded.state_dict, path)


def load_model(
    path: str | Path,
    *,
    expected: Mapping[str, Any] | None = None,
    source: str = "--model",
    map_location: str | torch.device = "cpu",
) -> tuple[UNet, ModelSpec]:
    """The UNet stored in ``path`` and its spec, after checking it against ``expected`` (see ``check_expected``)."""
    loaded = read_model_weights(path, map_location)
    spec = spec_of(loaded, path)
    check_expected(spec, expected or {}, path, source=source)
    model = spec.build()
    load_weights_into(model, loaded, path)
    return model, spec
