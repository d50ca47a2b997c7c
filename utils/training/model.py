"""The model of a training run: a UNet as the flags and images describe it, with the weights it starts from.

Built by ``utils.training.setup.build_parts`` on every rank. The weights come from ``--load`` (or
``--encoder-weights``), after checking that they were made for this model (``utils.checkpoint.model``); a resumed
checkpoint is checked here (``check_resume``: made for this model, on the same images) and loaded with the rest of the
run's state (``utils.checkpoint.checkpointer.restore``). ``wrap_for_training`` then gives the model the forward pass
calls (DDP and/or compiled).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from unet import UNetArgs
from unet import build_model as build_architecture
from utils.checkpoint.format import TrainingState, dataset_record
from utils.checkpoint.model import check_expected, load_model, spec_of
from utils.datasets.splits import check_same_split
from utils.errors import ConfigError
from utils.launch.process_group import DistributedContext, convert_sync_batchnorm
from utils.training.compiled import compile_blocks
from utils.training.config import TrainConfig
from utils.training.data import TrainData
from utils.training.encoder_weights import load_encoder_weights

logger = logging.getLogger(__name__)


def unet_args_of(config: TrainConfig, data: TrainData) -> UNetArgs:
    """The model the flags and the images describe."""
    return UNetArgs(
        n_channels=data.n_channels,
        n_classes=config.model.classes,
        bilinear=config.model.bilinear,
        base_channels=config.model.base_channels,
        encoder=config.model.encoder,
        deep_supervision=config.model.deep_supervision,
    )


def check_resume(config: TrainConfig, data: TrainData, state: TrainingState, path: str) -> None:
    """Refuse a resumed ``state`` made for another model than the flags and images describe, on other files, or on
    another train/validation split (checked last: a changed file list, named first, is the likelier cause)."""
    _check_same_dataset(state.dataset, data, path)
    # Every argument is compared with the file's, the optional ones too (as_dict leaves out their defaults).
    check_expected(
        spec_of(state.weights, path),
        dataclasses.asdict(unet_args_of(config, data)),
        path,
        source="--resume",
        images_from="--imgs",
    )
    _warn_mask_values(state.weights.mask_values, data.mask_values, path)
    check_same_split(state.weights.split_digest, data.split, path)


def starting_model(
    config: TrainConfig, ctx: DistributedContext, data: TrainData, *, resuming: bool
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model (UNet, or ResNet-encoder UNet with --encoder) on ``ctx.device`` and its constructor arguments; its
    starting weights from --load, else --encoder-weights for the encoder (a resumed run's are restored later)."""
    unet_args = unet_args_of(config, data)
    model_args = unet_args.as_dict()
    load = config.checkpoint.load
    if load and not resuming:
        # Built from the file's arguments, which check_expected compared with every one of this run's.
        model, spec = load_model(load, expected=dataclasses.asdict(unet_args), source="--load", images_from="--imgs")
        _warn_mask_values(spec.mask_values, data.mask_values, load)
        logger.info("Model weights loaded from %s", load)
    else:
        model = build_architecture(model_args)
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
    return model, model_args


def wrap_for_training(model: torch.nn.Module, ctx: DistributedContext, *, compile_model: bool) -> torch.nn.Module:
    """The module the forward pass calls: ``model`` with its blocks compiled under --compile (sharing its tensors,
    ``utils.training.compiled``), in DDP when distributed."""
    train_model = compile_blocks(model) if compile_model else model
    if ctx.is_distributed:
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        train_model = DistributedDataParallel(train_model, device_ids=device_ids)
    return train_model


def _check_same_dataset(saved: dict[str, Any] | None, data: TrainData, path: str) -> None:
    """Refuse to continue a run on other files: the split and the epoch order are defined on the file list."""
    if saved is None:
        return  # written before datasets were recorded
    current = dataset_record(data.train_dataset.ids)
    if saved.get("fingerprint") != current["fingerprint"]:
        raise ConfigError(
            f"{path} was trained on another dataset ({saved.get('images')} images, now {current['images']} in "
            f"--imgs/--masks, or the same number with other file names); resume with the same --imgs and --masks, "
            f"or start a new run from its weights with --load {path}"
        )


def _warn_mask_values(stored: list | None, current: list, path: str) -> None:
    if stored is not None and list(stored) != list(current):
        logger.warning(
            "%s was trained with mask values %s but the masks now have %s: class indices may mean other things",
            path,
            stored,
            current,
        )
