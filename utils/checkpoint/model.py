"""The model a checkpoint describes: its UNet arguments and mask values, checked once, for every caller.

Training (``--load``, ``--resume``), ``predict.py``, ``evaluate.py`` and ``hubconf.py`` all build models from files
through this module, with one policy: the file decides the architecture, and a flag (or argument) that contradicts
it is an error that names the flag. Files that store no arguments (milesial/Pytorch-UNet's, the documented DDP
script's) have them inferred from the shapes of their weights.

The spec also says how images are prepared for the model: the scale it was trained at (the checkpoint's inference
record, ``utils.checkpoint.format.InferenceRecord``) and its channel count (grey photos for an RGB model are converted).
``resolve_scale`` is the one policy for a ``--scale`` flag: unset means the checkpoint's; a different explicit value
is used with one warning naming both.
Files without that record keep milesial/Pytorch-UNet's default, 0.5.

A file's ``model_args`` say which model to build; its weights say which model they belong to. Trusting the first
alone lets a damaged or crafted file make the process allocate a model of tens of GB (``base_channels=1024``) before
the weights are found not to fit. So before building (``spec_of``), after the weights' values passed the read's check
(finite, dense, floating point, BatchNorm variances non-negative: ``utils.checkpoint.format``):

* the arguments are compared with the weights' shapes on the meta device (no memory is allocated);
* the mask values are one per class, unique, and integers (grey values) or colours of 2-4 channels of 0..255, so
  each predicted class maps to one value of the output image.

Once a file passed, its weights load into the model its spec builds without further checks.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from unet import OPTIONAL_ARGS, UNetArgs, build_model
from utils.checkpoint.files import read_model_weights
from utils.checkpoint.format import InferenceRecord, LoadedWeights
from utils.errors import CheckpointError, count, first_line, shortened

logger = logging.getLogger(__name__)

# milesial/Pytorch-UNet's predict.py and evaluate default: used for files that do not record their training scale.
DEFAULT_SCALE = 0.5

# How a user sets each constructor argument (the image channels come from the data, not from a flag).
ARG_FLAGS = {
    "n_classes": "--classes",
    "bilinear": "--bilinear",
    "base_channels": "--base-channels",
    "encoder": "--encoder",
    "deep_supervision": "--deep-supervision",
}


@dataclass(frozen=True)
class ModelSpec(UNetArgs):
    """What builds a model from a checkpoint: UNet's constructor arguments (``UNetArgs``, the one owner of their names
    and defaults), the mask value of each class and the file's inference record, whole."""

    mask_values: list | None = None
    inference: InferenceRecord = InferenceRecord()
    """How the training images were prepared: the ``--scale`` (None when the file does not record it: milesial's do
    not), the void mask values (``--ignore-value``: never a class, never predicted) and the class names (empty when
    the file has none)."""
    split_digest: str | None = None
    """sha256 of the train/validation split it was trained on (``evaluate.py --split`` checks it); None: unrecorded."""

    @property
    def scale(self) -> float:
        """The resize factor images get by default: the training scale, else milesial's 0.5."""
        return DEFAULT_SCALE if self.inference.scale is None else self.inference.scale

    @property
    def model_args(self) -> dict[str, Any]:
        """The constructor arguments alone, as checkpoints store them (``UNetArgs.as_dict``): what ``build_model``
        takes."""
        return UNetArgs(**{field.name: getattr(self, field.name) for field in dataclasses.fields(UNetArgs)}).as_dict()


def infer_model_args(state_dict: Mapping[str, torch.Tensor], path: str | Path) -> dict[str, Any]:
    """UNet's constructor arguments recovered from the shapes of its weights (for files that do not store them)."""
    try:
        first_conv = state_dict["inc.double_conv.0.weight"]
        out_conv = state_dict["outc.conv.weight"]
    except KeyError as error:
        raise CheckpointError(f"{path}: the weights are not a UNet's (key {error.args[0]!r} is missing)") from error
    return UNetArgs(
        n_channels=int(first_conv.shape[1]),
        n_classes=int(out_conv.shape[0]),
        # Only the transposed-convolution variant has weights in its upsampling layers.
        bilinear="up1.up.weight" not in state_dict,
        base_channels=int(first_conv.shape[0]),
        deep_supervision="aux_heads.convs.0.weight" in state_dict,
    ).as_dict()


def spec_of(loaded: LoadedWeights, path: str | Path) -> ModelSpec:
    """The model ``loaded`` (read from ``path``) describes."""
    raw_args = loaded.model_args if loaded.model_args is not None else infer_model_args(loaded.state_dict, path)
    # Before anything is built from it; the arguments first, as the mask values check reads the class count.
    args = check_args_describe_weights(raw_args, loaded.state_dict, path)
    check_mask_values_of(loaded.mask_values, int(args["n_classes"]), path)
    return ModelSpec(
        **args, mask_values=loaded.mask_values, inference=loaded.inference, split_digest=loaded.split_digest
    )


def resolve_scale(spec: ModelSpec, flag_value: float | None, path: str | Path) -> float:
    """The scale to prepare images at: ``--scale``'s ``flag_value`` when given (warning once if it differs), else the
    spec's."""
    trained_at = spec.inference.scale
    if flag_value is None:
        if trained_at is None:
            logger.info("%s records no training scale; using --scale %s (milesial's default)", path, DEFAULT_SCALE)
        return spec.scale
    if trained_at is not None and flag_value != trained_at:
        logger.warning(
            "--scale %(asked)s differs from the scale %(path)s was trained at (%(trained)s); using %(asked)s as asked "
            "(drop --scale to use %(trained)s)",
            {"asked": flag_value, "path": path, "trained": trained_at},
        )
    return flag_value


def check_expected(
    spec: ModelSpec, expected: Mapping[str, Any], path: str | Path, *, source: str, images_from: str = "the input"
) -> None:
    """Refuse ``spec`` when it contradicts ``expected`` (arguments set by flags; None = not set).

    ``source`` names the flag the file came from (``--load``, ``--model``, ...), ``images_from`` where the images
    whose channel count is ``expected["n_channels"]`` come from (``--imgs``, ...).
    """
    for key, value in expected.items():
        stored = getattr(spec, key)  # a spec is its UNetArgs, the optional ones a file may omit filled in
        if value is None or stored == value:
            continue
        if key == "n_channels":
            raise CheckpointError(
                f"{source} {path} expects {stored}-channel images but the images in {images_from} have {value} "
                "channels; use a checkpoint trained on such images"
            )
        flag = ARG_FLAGS[key]
        switch = f"pass {flag}" if stored else f"drop {flag}"  # --bilinear, --deep-supervision take no value
        fix = switch if isinstance(stored, bool) else f"pass {flag} {stored}"
        raise CheckpointError(
            f"{source} {path} was trained with {key}={stored!r} but {flag} asks for {value!r}; {fix} or use a "
            f"matching checkpoint"
        )


def load_model(
    path: str | Path,
    *,
    expected: Mapping[str, Any] | None = None,
    source: str = "--model",
    images_from: str = "the input",
) -> tuple[torch.nn.Module, ModelSpec]:
    """The UNet stored in ``path`` (read to the CPU) and its spec, after checking it against ``expected`` (see
    ``check_expected``)."""
    loaded = read_model_weights(path)
    spec = spec_of(loaded, path)
    check_expected(spec, expected or {}, path, source=source, images_from=images_from)
    model = build_model(spec.model_args)
    model.load_state_dict(loaded.state_dict)  # spec_of checked that the file's arguments describe its weights
    return model, spec


# Grey mask values are written to PNG (16 bits at most) by predict: utils.inference.writer.
MAX_GREY_MASK_VALUE = 2**32 - 1
"""The widest grey value a mask file can hold (32-bit masks train); predict refuses more than PNG's 16 bits."""


def check_args_describe_weights(args: Any, state_dict: Mapping[str, torch.Tensor], path: Any) -> dict[str, Any]:
    """``args`` (a file's ``model_args``) when they are ``UNetArgs``' names and types and build, on the meta device,
    the model whose tensors ``state_dict`` holds; else a CheckpointError.

    Nothing is allocated before the shapes agree, and the weights are in memory already: a damaged or crafted file
    cannot make the process allocate a model larger than the file (``base_channels=1024`` over a base-8 model).
    """
    if not isinstance(args, Mapping):
        raise CheckpointError(f"{path}: model_args is a {type(args).__name__}, not a mapping; the file is damaged")
    types = {field.name: type(field.default) for field in dataclasses.fields(UNetArgs)}
    unknown, missing = sorted(set(args) - set(types)), sorted(set(types) - set(args) - set(OPTIONAL_ARGS))
    if unknown or missing:
        problem = f"unknown keys {unknown}" if unknown else f"missing keys {missing}"
        raise CheckpointError(f"{path}: model_args has {problem}; it was not written by a compatible unet-ddp")
    for key, value in args.items():
        if type(value) is not types[key]:  # bool is not int here: n_classes=True is refused
            raise CheckpointError(f"{path}: model_args {key}={value!r} is not of type {types[key].__name__}")
    if args.get("encoder", UNetArgs.encoder) != UNetArgs.encoder and args["bilinear"]:
        raise CheckpointError(f"{path}: model_args asks for bilinear upsampling, which only the unet encoder has")
    try:
        with torch.device("meta"):
            expected = build_model(dict(args)).state_dict()
    except (ValueError, TypeError, RuntimeError) as error:  # sizes below 1, an unknown encoder, sizes past torch's
        message = f"{path}: model_args {dict(args)} describe no model ({first_line(error)}); the file is damaged"
        raise CheckpointError(message) from None
    mismatch = weights_mismatch(expected, state_dict)
    if mismatch is not None:
        raise CheckpointError(
            f"checkpoint {path} contradicts itself: its model_args {dict(args)} do not describe its weights "
            f"({mismatch}); the file is damaged or was edited, use another checkpoint"
        )
    return dict(args)


def weights_mismatch(model: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor]) -> str | None:
    """What keeps ``weights`` from loading into a model whose state dict is ``model``: the first tensor whose shape
    differs, else the tensors one of them lacks; None when they fit. The one wording of a mismatch, for checkpoints
    and ``--encoder-weights``."""
    reshaped = [key for key in model if key in weights and model[key].shape != weights[key].shape]
    missing = [key for key in model if key not in weights]
    unexpected = [key for key in weights if key not in model]
    if reshaped:
        key = reshaped[0]
        return f"{key} has shape {tuple(weights[key].shape)} in the weights but {tuple(model[key].shape)} in the model"
    if missing:
        return f"the model has {count(len(missing), 'tensor')} the weights lack (e.g. {missing[0]})"
    if unexpected:
        return f"the weights hold {count(len(unexpected), 'tensor')} the model lacks (e.g. {unexpected[0]})"
    return None


def check_mask_values_of(mask_values: Any, n_classes: int, path: Any) -> None:
    """``mask_values``: one unique integer (or colour) per predicted class; None (not recorded) passes."""
    problem = _mask_values_problem(mask_values, 2 if n_classes == 1 else n_classes)
    if problem is not None:
        shown = shortened(list(mask_values) if isinstance(mask_values, tuple) else mask_values)
        raise CheckpointError(
            f"checkpoint {path}: mask_values {shown} {problem}; the file is damaged or was edited, use another "
            f"checkpoint"
        )


def _mask_values_problem(mask_values: Any, n_predicted: int) -> str | None:
    """What keeps ``mask_values`` from mapping each of ``n_predicted`` classes to its own value a mask file can hold:
    a grey value (an integer) or a colour (2-4 integers in 0..255), not mixed; None when nothing does."""
    if mask_values is None:
        return None
    if not isinstance(mask_values, list | tuple):
        return "are not a list"
    if len(mask_values) != n_predicted:
        return f"name {len(mask_values)} values but the model predicts {n_predicted} classes (one value per class)"
    for value in mask_values:
        colour = isinstance(value, list | tuple)
        if not colour and not _is_integer(value, MAX_GREY_MASK_VALUE):
            return f"hold {value!r}, not an integer in 0..{MAX_GREY_MASK_VALUE} (or a colour)"
        if colour and not (2 <= len(value) <= 4 and all(_is_integer(part, 255) for part in value)):
            return f"hold {value!r}, not a colour of 2-4 integers in 0..255"
    # Equal numbers are equal keys (1, 1.0 and True alike), as they are one value in a mask file.
    keys = [tuple(value) if isinstance(value, list | tuple) else (value,) for value in mask_values]
    if len({len(key) for key in keys}) > 1:
        return "mix grey values and colours, or colours of different lengths"
    if len(set(keys)) != len(keys):
        return "repeat a value, so two classes would be written the same"
    return None


def _is_integer(value: Any, high: int) -> bool:
    """An integer in 0..``high``: an int, a float without a fraction, or a bool (milesial's 1-bit masks give False,
    True)."""
    return isinstance(value, int | float) and 0 <= value <= high and float(value).is_integer()
