"""A resumable run's state: where it stands (``TrainPosition``), the checkpoint payload that records it, and the RNG.

``TrainingState`` is the one typed write (``to_payload``) and read (``of``) of a resumable checkpoint's keys; the key
constants, the format-version check, the digests and the model weights' prefixes belong to ``utils.checkpoint.format``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from utils.checkpoint.files import load_checkpoint_file
from utils.checkpoint.format import (
    FORMAT_VERSION,
    KEY_ARGS,
    KEY_BEST_DICE,
    KEY_BEST_EPOCH,
    KEY_BEST_RANKING,
    KEY_DATASET,
    KEY_EPOCH,
    KEY_FORMAT_VERSION,
    KEY_GLOBAL_STEP,
    KEY_INFERENCE,
    KEY_LIVE_MODEL,
    KEY_MASK_VALUES,
    KEY_MODEL,
    KEY_MODEL_ARGS,
    KEY_OPTIMIZER,
    KEY_RNG,
    KEY_SCALER,
    KEY_SCHEDULER,
    KEY_SPLIT_DIGEST,
    KEY_STEP_IN_EPOCH,
    KEY_TENSOR_DIGESTS,
    KEY_VALIDATIONS_WITHOUT_IMPROVEMENT,
    KEY_WORLD_SIZE,
    LoadedWeights,
    weights_of,
)
from utils.errors import CheckpointError

# What best.pth and best-K.pth hold: the weights, what inference rebuilds the model and prepares images from, and where
# the run stood; no optimizer state (two more copies of the weights' size with AdamW), so they cannot be resumed.
WEIGHTS_ONLY_KEYS = (
    KEY_FORMAT_VERSION,
    KEY_MODEL,
    KEY_MODEL_ARGS,
    KEY_MASK_VALUES,
    KEY_INFERENCE,
    KEY_EPOCH,
    KEY_GLOBAL_STEP,
    KEY_BEST_DICE,
    KEY_SPLIT_DIGEST,  # evaluate.py --split refuses another split than the weights were trained on
)
RESUME_KEYS = (KEY_MODEL, KEY_OPTIMIZER, KEY_SCHEDULER, KEY_EPOCH, KEY_GLOBAL_STEP, KEY_STEP_IN_EPOCH)


@dataclass
class TrainPosition:
    """Where training stands: ``epoch`` epochs fully done, plus ``step_in_epoch`` batches of the next one.

    Each field is saved under its own name (``KEY_EPOCH`` is ``"epoch"``, ...): ``TrainingState.to_payload`` writes the
    fields as they are, ``position_of`` reads them back with the defaults of files that predate some.
    """

    epoch: int = 0
    global_step: int = 0
    step_in_epoch: int = 0
    best_dice: float = float("-inf")
    best_ranking: list[list[float]] = field(default_factory=list)
    """--keep-best: ``[dice, global_step]`` of the states in ``best-1.pth``, ``best-2.pth``, ... (best first)."""
    best_epoch: int = 0
    """The epoch whose validation gave ``best_dice`` (0: none yet)."""
    validations_without_improvement: int = 0
    """--patience: validations since the last one that improved on the best Dice by more than --min-delta."""


@dataclass
class TrainingState:
    """Everything a resumable checkpoint holds: the one typed write (``to_payload``) and read (``of``) of its keys.

    ``weights`` are the weights being trained (the unwrapped module's state dict) with the record that describes them
    (its arguments, mask values, inference record and split digest), as every reader of model weights takes them;
    ``optimizer``, ``scheduler`` and ``scaler`` are state dicts (``scaler`` None unless fp16 scaling is on).
    ``run_args`` are the run's flags, kept for the resume checks and the epoch plan; nothing that prepares images for
    inference reads them (that is ``weights.inference``).
    """

    weights: LoadedWeights
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    scaler: dict[str, Any] | None
    position: TrainPosition
    run_args: dict[str, Any]
    world_size: int
    dataset: dict[str, Any] | None = None
    rng: dict[str, Any] | None = None
    ema: dict[str, torch.Tensor] | None = None
    """--ema: the averaged weights (a state dict like ``weights.state_dict``); None when the run keeps no average."""
    digests: dict[str, Any] | None = None
    """The tensor digests the file was saved with (``utils.checkpoint.format``; None in older files): read, to tell
    whether two files hold one state, never written from here (every save computes them)."""

    def to_payload(self) -> dict[str, Any]:
        """The checkpoint dictionary (DESIGN.md, format version 1), RNG state captured now when not set."""
        weights = self.weights
        return {
            KEY_FORMAT_VERSION: FORMAT_VERSION,
            # With an average, model_state is the average (what inference reads) and the live weights move aside.
            KEY_MODEL: weights.state_dict if self.ema is None else self.ema,
            KEY_MODEL_ARGS: dict(weights.model_args),
            KEY_MASK_VALUES: list(weights.mask_values),
            KEY_INFERENCE: weights.inference.as_dict(),
            KEY_OPTIMIZER: self.optimizer,
            KEY_SCHEDULER: self.scheduler,
            KEY_SCALER: self.scaler,
            KEY_RNG: capture_rng_state() if self.rng is None else self.rng,
            KEY_ARGS: dict(self.run_args),
            KEY_WORLD_SIZE: self.world_size,
            KEY_DATASET: self.dataset,
            KEY_SPLIT_DIGEST: weights.split_digest,
            # The position's field names are its keys (KEY_EPOCH, ..., KEY_BEST_RANKING): position_of reads them.
            **dataclasses.asdict(self.position),
            **({} if self.ema is None else {KEY_LIVE_MODEL: weights.state_dict}),
        }

    @classmethod
    def of(cls, payload: dict[str, Any], path: str | Path) -> TrainingState:
        """The state in ``payload`` (read from ``path`` by ``load_checkpoint_file``), else a CheckpointError."""
        missing = [key for key in RESUME_KEYS if key not in payload]
        if missing:
            raise CheckpointError(
                f"{path} cannot be resumed: it lacks {', '.join(missing)} (weights-only files start a new run with "
                f"--load)"
            )
        weights, ema = weights_of(payload, path), None
        if isinstance(payload.get(KEY_LIVE_MODEL), dict):  # an --ema run: model_state is the average
            weights, ema = dataclasses.replace(weights, state_dict=payload[KEY_LIVE_MODEL]), weights.state_dict
        run_args = payload.get(KEY_ARGS)
        dataset = payload.get(KEY_DATASET)
        return cls(
            weights=weights,
            optimizer=payload[KEY_OPTIMIZER],
            scheduler=payload[KEY_SCHEDULER],
            scaler=payload.get(KEY_SCALER) or None,
            position=position_of(payload),
            run_args=dict(run_args) if isinstance(run_args, dict) else {},
            world_size=int(payload.get(KEY_WORLD_SIZE) or 1),
            dataset=dataset if isinstance(dataset, dict) else None,
            rng=payload.get(KEY_RNG),
            ema=ema,
            digests=payload.get(KEY_TENSOR_DIGESTS),
        )


def dataset_record(image_ids: Sequence[str]) -> dict[str, Any]:
    """What a checkpoint records of its dataset: the number of images and a sha256 of their sorted ids."""
    digest = hashlib.sha256("\n".join(sorted(image_ids)).encode()).hexdigest()
    return {"fingerprint": digest, "images": len(image_ids)}


def position_of(payload: dict[str, Any]) -> TrainPosition:
    return TrainPosition(
        epoch=int(payload[KEY_EPOCH]),
        global_step=int(payload[KEY_GLOBAL_STEP]),
        step_in_epoch=int(payload[KEY_STEP_IN_EPOCH]),
        best_dice=float(payload.get(KEY_BEST_DICE, float("-inf"))),
        best_ranking=[[float(dice), int(step)] for dice, step in payload.get(KEY_BEST_RANKING) or []],
        best_epoch=int(payload.get(KEY_BEST_EPOCH) or 0),
        validations_without_improvement=int(payload.get(KEY_VALIDATIONS_WITHOUT_IMPROVEMENT) or 0),
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


def load_resume_checkpoint(path: str | Path) -> TrainingState:
    """The state of a checkpoint that holds everything needed to continue training, else a CheckpointError naming
    what is missing."""
    return TrainingState.of(load_checkpoint_file(path), path)
