"""--encoder-weights: a torchvision ResNet state dict from a local file, loaded into a ResNet-encoder UNet.

The file is what torchvision itself downloads and caches (``~/.cache/torch/hub/checkpoints/resnet34-b627a593.pth``):
a plain state dict with keys ``conv1.weight``, ``bn1.*``, ``layer1.*`` ... ``fc.*``. The classifier (``fc.*``) is
dropped; every other key must match the encoder exactly, so a resnet50 file given to ``--encoder resnet34`` (or a
file that is not a ResNet's) is refused with one message naming the file. Nothing is downloaded here or anywhere
else: the file is read and checked as every weights file is (``utils.checkpoint.files.read_model_weights``: never
unpickles code, refuses NaN and inf; ``module.`` prefixes and a ``state_dict`` wrapper are taken off), and its values
pass the checkpoints' check (``utils.checkpoint.model.check_weight_values``: dense, floating point, BatchNorm
variances >= 0), so a damaged file is refused naming it before a step is trained.
"""

from __future__ import annotations

import logging
from pathlib import Path

from torch import nn

from utils.checkpoint.files import read_model_weights
from utils.checkpoint.model import check_weight_values, key_differences
from utils.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

# The classifier of torchvision's ResNets: no counterpart in a segmentation encoder.
DROPPED_PREFIXES = ("fc.",)
HOW_TO_GET = (
    "torchvision's files are made once on a machine with internet, e.g. python -c \"import torchvision; "
    "torchvision.models.resnet34(weights='IMAGENET1K_V1')\", then found in ~/.cache/torch/hub/checkpoints/"
)


def load_encoder_weights(encoder: nn.Module, path: str | Path, encoder_name: str) -> None:
    """Copy the torchvision state dict in ``path`` (``fc.*`` dropped) into ``encoder`` (a
    ``unet.resnet_unet.ResNetEncoder``), refusing any mismatch."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--encoder-weights {path}: no such file; {HOW_TO_GET}")
    try:
        # The one safe read of every weights file, and its reading of wrapped and nested state dicts.
        weights = read_model_weights(path).state_dict
    except CheckpointError as error:
        raise ConfigError(
            f"--encoder-weights {path} is not a usable torch state dict ({error}); {HOW_TO_GET}"
        ) from None
    weights = {key: value for key, value in weights.items() if not key.startswith(DROPPED_PREFIXES)}
    check_weight_values(weights, path, source="--encoder-weights", fix=f"make the file again: {HOW_TO_GET}")
    own = encoder.state_dict()
    missing, unexpected, mismatched = key_differences(own, weights)
    if missing or unexpected or mismatched:
        hint = ""
        if mismatched:
            key = mismatched[0]
            detail = f"{key} is {tuple(weights[key].shape)} in the file but {tuple(own[key].shape)} in the model"
            if key == "conv1.weight":
                hint = " (ImageNet weights are for 3-channel images)"
        elif missing:
            detail = f"{len(missing)} encoder keys are missing, e.g. {missing[0]}"
        else:
            detail = f"{len(unexpected)} keys are not the encoder's, e.g. {unexpected[0]}"
        raise ConfigError(
            f"--encoder-weights {path} does not fit --encoder {encoder_name}: {detail}{hint}; pass the weights of "
            f"a torchvision {encoder_name}, or the --encoder the file was made for"
        )
    encoder.load_state_dict(weights)
    logger.info("Encoder weights (%s) loaded from %s", encoder_name, path)
