"""Training state: where a run stands, the checkpoint payload that records it, and restoring it (RNG included).

The file names of the run folder and the choice of the checkpoint to resume belong to ``utils.training.run_folder``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from utils.checkpoint import (
    FORMAT_VERSION,
    KEY_ARGS,
    KEY_BEST_DICE,
    KEY_EPOCH,
    KEY_FORMAT_VERSION,
    KEY_GLOBAL_STEP,
    KEY_MASK_VALUES,
    KEY_MODEL,
    KEY_MODEL_ARGS,
    KEY_OPTIMIZER,
    KEY_RNG,
    KEY_SCALER,
    KEY_SCHEDULER,
    KEY_STEP_IN_EPOCH,
    KEY_WORLD_SIZE,
    load_checkpoint_file,
)
from utils.errors import CheckpointError

RESUME_KEYS = (KEY_MODEL, KEY_OPTIMIZER, KEY_SCHEDULER, KEY_EPOCH, KEY_GLOBAL_STEP, KEY_STEP_IN_EPOCH)


@dataclass
class TrainPosition:
    """Where training stands: ``epoch`` epochs fully done, plus ``step_in_epoch`` batches of the next one."""

    epoch: int = 0
    global_step: int = 0
    step_in_epoch: int = 0
    best_dice: float = float("-inf")


def build_payload(
    *,
    model: torch.nn.Module,
    model_args: dict[str, Any],
    mask_values: list,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: torch.amp.GradScaler | None,
    position: TrainPosition,
    args: dict[str, Any],
    world_size: int,
) -> dict[str, Any]:
    """The checkpoint dictionary (DESIGN.md, format version 1); ``model`` is the unwrapped module."""
    return {
        KEY_FORMAT_VERSION: FORMAT_VERSION,
        KEY_MODEL: model.state_dict(),
        KEY_MODEL_ARGS: dict(model_args),
        KEY_MASK_VALUES: list(mask_values),
        KEY_OPTIMIZER: optimizer.state_dict(),
        KEY_SCHEDULER: scheduler.state_dict(),
        KEY_SCALER: scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
        KEY_EPOCH: position.epoch,
        KEY_GLOBAL_STEP: position.global_step,
        KEY_STEP_IN_EPOCH: position.step_in_epoch,
        KEY_RNG: capture_rng_state(),
        KEY_ARGS: dict(args),
        KEY_BEST_DICE: position.best_dice,
        KEY_WORLD_SIZE: world_size,
    }


def position_of(payload: dict[str, Any]) -> TrainPosition:
    return TrainPosition(
        epoch=int(payload[KEY_EPOCH]),
        global_step=int(payload[KEY_GLOBAL_STEP]),
        step_in_epoch=int(payload[KEY_STEP_IN_EPOCH]),
        best_dice=float(payload.get(KEY_BEST_DICE, float("-inf"))),
    )


def capture_rng_state() -> dict[str, Any]:
    """torch/CUDA/numpy/python RNG states as tensors and plain values (loadable with weights_only=True).

    Training draws no random numbers after initialisation (data order and augmentation are pure functions of the
    seed, epoch and index), so these are stored for completeness and for anything a user adds, not for exactness.
    """
    numpy_state = np.random.get_state()
    python_state = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(numpy_state[1].astype(np.int64)),
            "pos": int(numpy_state[2]),
            "has_gauss": int(numpy_state[3]),
            "cached_gaussian": float(numpy_state[4]),
        },
        "python": {"version": python_state[0], "state": list(python_state[1]), "gauss_next": python_state[2]},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    python_state = state["python"]
    random.setstate((python_state["version"], tuple(python_state["state"]), python_state["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)


def load_resume_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint that holds everything needed to continue training, else a CheckpointError naming what is missing."""
    payload = load_checkpoint_file(path)
    missing = [key for key in RESUME_KEYS if key not in payload]
    if missing:
        raise CheckpointError(
            f"{path} cannot be resumed: it lacks {', '.join(missing)} (weights-only files start a new run with --load)"
        )
    return payload
