"""Training checkpoints: building the payload, finding the one to resume from, restoring it, and rotating old files.

The run folder ``<checkpoint_dir>/<exp_name>/`` holds (all in the one format of ``utils/checkpoint.py``):

* ``last.pth``: the newest state, written at every epoch end, every ``--save-every-steps`` optimizer steps and when
  ``--max-steps`` stops the run (mid-epoch states carry their position in ``step_in_epoch``);
* ``checkpoint_epoch{N}.pth``: every ``--save_every`` epochs, the newest ``--keep-last`` kept;
* ``best.pth``: the state with the best validation Dice;
* ``INTERRUPTED.pth``: written when SIGINT/SIGTERM stopped the run.

``--resume auto`` takes the most recently written of these that loads completely; a corrupt one is skipped with a
warning, and a folder without checkpoints starts a new run (so one command serves the first start and every
restart of a requeued job). Only global rank 0 writes, each file atomically.
"""

from __future__ import annotations

import logging
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .checkpoint import (
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
from .errors import CheckpointError

logger = logging.getLogger(__name__)

LAST_NAME = "last.pth"
BEST_NAME = "best.pth"
INTERRUPTED_NAME = "INTERRUPTED.pth"
EPOCH_PATTERN = re.compile(r"^checkpoint_epoch(\d+)\.pth$")
RESUME_KEYS = (KEY_MODEL, KEY_OPTIMIZER, KEY_SCHEDULER, KEY_EPOCH, KEY_GLOBAL_STEP, KEY_STEP_IN_EPOCH)


def epoch_checkpoint_name(epoch_number: int) -> str:
    return f"checkpoint_epoch{epoch_number}.pth"


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


def resume_candidates(run_dir: Path) -> list[Path]:
    """Checkpoints of the run folder, most recently written first."""
    if not run_dir.is_dir():
        return []
    names = {LAST_NAME, BEST_NAME, INTERRUPTED_NAME}
    files = [p for p in run_dir.iterdir() if p.is_file() and (p.name in names or EPOCH_PATTERN.match(p.name))]
    return sorted(files, key=lambda p: p.stat().st_mtime_ns, reverse=True)


def find_resume_checkpoint(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest complete checkpoint of ``run_dir`` and its contents, None when the folder holds no checkpoint.

    Corrupt or incomplete files are skipped with a warning; if there are only such files, that is an error rather
    than a fresh start that would overwrite them.
    """
    candidates = resume_candidates(run_dir)
    for path in candidates:
        try:
            return path, load_resume_checkpoint(path)
        except CheckpointError as error:
            logger.warning("skipping %s for --resume auto: %s", path, error)
    if candidates:
        raise CheckpointError(
            f"--resume auto found no usable checkpoint in {run_dir} (all are corrupt or incomplete, see above); "
            f"pass a checkpoint with --resume PATH, or move the folder away to start a new run"
        )
    return None


def prune_epoch_checkpoints(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoint_epoch files (by epoch number); returns the deleted paths."""
    if keep_last <= 0:
        return []
    numbered = []
    for path in run_dir.iterdir():
        match = EPOCH_PATTERN.match(path.name)
        if match:
            numbered.append((int(match.group(1)), path))
    numbered.sort()
    doomed = [path for _, path in numbered[:-keep_last]]
    for path in doomed:
        path.unlink(missing_ok=True)
    return doomed
