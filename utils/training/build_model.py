"""The model of a training run: a UNet as the flags and images describe it, with the weights it starts from.

Built by ``utils.training.setup.build_parts`` on every rank. The weights come from the checkpoint being resumed, or
from ``--load``, after checking that they were made for this model (``utils.model_spec``) and, for a resume, on the
same images. ``wrap_for_training`` then gives the model the forward pass calls (DDP and/or compiled).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from unet import UNetArgs
from unet import build_model as build_architecture
from utils.checkpoint import LoadedWeights, read_model_weights
from utils.errors import ConfigError
from utils.launch.process_group import DistributedContext, convert_sync_batchnorm
from utils.model_spec import check_expected, load_weights_into, spec_of
from utils.training.config import TrainConfig
from utils.training.data import TrainData
from utils.training.encoder_weights import load_encoder_weights
from utils.training.state import TrainingState, dataset_record

logger = logging.getLogger(__name__)


def build_model(
    config: TrainConfig,
    ctx: DistributedContext,
    data: TrainData,
    resume_path: str | None,
    state: TrainingState | None,
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model (UNet, or ResNet-encoder UNet with --encoder) on ``ctx.device`` with its starting weights (``state``
    read from ``resume_path``, else --load, else --encoder-weights for the encoder), and its constructor arguments."""
    unet_args = UNetArgs(
        n_channels=data.n_channels,
        n_classes=config.model.classes,
        bilinear=config.model.bilinear,
        base_channels=config.model.base_channels,
        encoder=config.model.encoder,
        deep_supervision=config.model.deep_supervision,
    )
    model_args = unet_args.as_dict()
    # Every argument is compared with a file's, the optional ones too (as_dict leaves out their defaults).
    wanted_args = dataclasses.asdict(unet_args)
    model = build_architecture(model_args)
    if state is not None:
        assert resume_path is not None  # a state is always read from a file
        _check_same_dataset(state.dataset, data, resume_path)
        _load_weights(model, state.weights, wanted_args, resume_path, "--resume")
        _warn_mask_values(state.mask_values, data.mask_values, resume_path)
    elif config.checkpoint.load:
        loaded = read_model_weights(config.checkpoint.load)
        _load_weights(model, loaded, wanted_args, config.checkpoint.load, "--load")
        _warn_mask_values(loaded.mask_values, data.mask_values, config.checkpoint.load)
        logger.info("Model weights loaded from %s", config.checkpoint.load)
    elif config.model.encoder_weights:
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
    """The module the forward pass calls: ``model`` in DDP when distributed, compiled with --compile."""
    train_model = model
    if ctx.is_distributed:
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        train_model = DistributedDataParallel(model, device_ids=device_ids)
    if compile_model:
        train_model = torch.compile(train_model)
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


def _load_weights(
    model: torch.nn.Module, loaded: LoadedWeights, wanted_args: dict[str, Any], path: str, flag: str
) -> None:
    """Load ``loaded`` after checking it was made for the model these flags and images describe."""
    spec = spec_of(loaded, path)
    check_expected(spec, wanted_args, path, source=flag, images_from="--imgs")
    load_weights_into(model, loaded, path)


def _warn_mask_values(stored: list | None, current: list, path: str) -> None:
    if stored is not None and list(stored) != list(current):
        logger.warning(
            "%s was trained with mask values %s but the masks now have %s: class indices may mean other things",
            path,
            stored,
            current,
        )
