"""The model of a training run: a UNet as the flags and images describe it, with the weights it starts from.

Built by ``utils.training.setup.build_parts`` on every rank. The weights come from ``--load`` (or
``--encoder-weights``, ``load_encoder_weights``), after checking that they were made for this model
(``utils.checkpoint.model``); a resumed
checkpoint is checked here (``check_resume``: made for this model, on the same images) and loaded with the rest of the
run's state (``utils.checkpoint.checkpointer.restore``). ``utils.training.step.TrainStep`` then gives the model the
forward pass calls (DDP and/or compiled).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from torch import nn

from unet import UNetArgs
from unet import build_model as build_architecture
from utils.checkpoint.files import read_model_weights
from utils.checkpoint.format import TrainingState, dataset_record
from utils.checkpoint.model import check_expected, load_model, spec_of, weights_mismatch
from utils.datasets.splits import check_same_split
from utils.errors import CheckpointError, ConfigError
from utils.launch.process_group import DistributedContext, convert_sync_batchnorm
from utils.training.config import TrainConfig
from utils.training.data import TrainData

logger = logging.getLogger(__name__)

# The model section's fields that carry these names are the model's arguments as they are.
UNET_ARG_NAMES = {item.name for item in dataclasses.fields(UNetArgs)}
# The classifier of torchvision's ResNets: no counterpart in a segmentation encoder.
DROPPED_PREFIXES = ("fc.",)
HOW_TO_GET = (
    "torchvision's files are made once on a machine with internet, e.g. python -c \"import torchvision; "
    "torchvision.models.resnet34(weights='IMAGENET1K_V1')\", then found in ~/.cache/torch/hub/checkpoints/"
)


def unet_args_of(config: TrainConfig, data: TrainData) -> UNetArgs:
    """The model the flags and the images describe: the channels of the images, --classes, and the model section's
    fields that carry ``UNetArgs``'s names (--bilinear, --base-channels, --encoder, --deep-supervision)."""
    named = {key: value for key, value in dataclasses.asdict(config.model).items() if key in UNET_ARG_NAMES}
    return UNetArgs(n_channels=data.n_channels, n_classes=config.model.classes, **named)


def check_resume(config: TrainConfig, data: TrainData, state: TrainingState, path: str) -> None:
    """Refuse a resumed ``state`` made for another model than the flags and images describe, on other files (the split
    and the epoch order are defined on the file list), or on another train/validation split (checked last: a changed
    file list, named first, is the likelier cause)."""
    saved = state.dataset  # None: written before datasets were recorded
    current = dataset_record(data.train_dataset.ids)
    if saved is not None and saved.get("fingerprint") != current["fingerprint"]:
        raise ConfigError(
            f"{path} was trained on another dataset ({saved.get('images')} images, now {current['images']} in "
            f"--imgs/--masks, or the same number with other file names); resume with the same --imgs and --masks, "
            f"or start a new run from its weights with --load {path}"
        )
    # Every argument is compared with the file's, the optional ones too (as_dict leaves out their defaults).
    expected = dataclasses.asdict(unet_args_of(config, data))
    check_expected(spec_of(state.weights, path), expected, path, source="--resume", images_from="--imgs")
    _warn_mask_values(state.weights.mask_values, data.mask_values, path)
    check_same_split(state.weights.split_digest, data.split, path)


def starting_model(config: TrainConfig, ctx: DistributedContext, data: TrainData, *, resuming: bool) -> nn.Module:
    """The model (UNet, or ResNet-encoder UNet with --encoder) on ``ctx.device``; its starting weights from --load,
    else --encoder-weights for the encoder (a resumed run's are restored later)."""
    unet_args = unet_args_of(config, data)
    load = config.checkpoint.load
    if load and not resuming:
        # Built from the file's arguments, which check_expected compared with every one of this run's.
        model, spec = load_model(load, expected=dataclasses.asdict(unet_args), source="--load", images_from="--imgs")
        _warn_mask_values(spec.mask_values, data.mask_values, load)
        logger.info("Model weights loaded from %s", load)
    else:
        model = build_architecture(unet_args.as_dict())
        if config.model.encoder_weights and not resuming:
            load_encoder_weights(model.encoder, config.model.encoder_weights, config.model.encoder)
    if config.performance.checkpointing:
        model.use_checkpointing()
    if config.launch.sync_bn:
        if ctx.is_distributed:
            model = convert_sync_batchnorm(model, ctx.device)
        else:
            logger.warning("--sync-bn has no effect with a single process")
    memory_format = torch.channels_last if config.performance.channels_last else torch.preserve_format
    model.to(device=ctx.device, memory_format=memory_format)
    return model


def _warn_mask_values(stored: list | None, current: list, path: str) -> None:
    if stored is not None and list(stored) != list(current):
        logger.warning(
            f"{path} was trained with mask values {stored} but the masks now have {current}: class indices may mean "
            "other things"
        )


def load_encoder_weights(encoder: nn.Module, path: str | Path, encoder_name: str) -> None:
    """--encoder-weights: copy the torchvision state dict in ``path`` (``fc.*`` dropped) into ``encoder`` (a
    ``ResNetUNet.encoder``), refusing any mismatch.

    The file is what torchvision itself downloads and caches (``~/.cache/torch/hub/checkpoints/resnet34-b627a593.pth``):
    a plain state dict with keys ``conv1.weight``, ``bn1.*``, ``layer1.*`` ... ``fc.*``. The classifier (``fc.*``) is
    dropped; every other key must match the encoder exactly, so a resnet50 file given to ``--encoder resnet34`` (or a
    file that is not a ResNet's) is refused with one message naming the file. Nothing is downloaded here or anywhere
    else: the file is read and checked as every weights file is (``utils.checkpoint.files.read_model_weights``: never
    unpickles code, refuses NaN and inf, integer, sparse weights and negative BatchNorm variances; ``module.`` prefixes
    and a ``state_dict`` wrapper are taken off), so a damaged file is refused naming it before a step is trained.
    """
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
    mismatch = weights_mismatch(encoder.state_dict(), weights)
    if mismatch is not None:
        hint = " (ImageNet weights are for 3-channel images)" if mismatch.startswith("conv1.weight ") else ""
        raise ConfigError(
            f"--encoder-weights {path} does not fit --encoder {encoder_name}: {mismatch}{hint}; pass the weights of "
            f"a torchvision {encoder_name}, or the --encoder the file was made for"
        )
    encoder.load_state_dict(weights)
    logger.info("Encoder weights (%s) loaded from %s", encoder_name, path)
