"""The one checkpoint format: its keys, the records it holds, its typed write and read, its digests and the formats
users bring.

Our files record a sha256 of every tensor (``KEY_TENSOR_DIGESTS``, computed once at save) and every read checks it,
so bytes changed on disk are an error naming the file, not wrong weights (a file of our format whose digests were
removed is refused too); every read also refuses model weights no training produces (NaN or inf, sparse, integer, a
negative BatchNorm variance: the only check possible for foreign files, which carry no digests) and checks the format
version. Foreign files: milesial/Pytorch-UNet's bare ``state_dict``,
``module.``/``_orig_mod.`` prefixes of wrapped models, and the DDP script's ``model_state_dict``.

What inference needs to prepare images (the training scale, the void mask values, the image channels) is its own
record (``KEY_INFERENCE``, ``InferenceRecord``), written at save time, so renaming a training flag can never change
how predict resizes; files written before the record existed are read from their ``args`` in one place
(``InferenceRecord.of``).

``TrainingState`` is the one typed write (``to_payload``) and read (``of``) of a resumable checkpoint, its state dicts
under their field names; where the run stands is its ``TrainPosition``, whose field names are their keys too. Reading
and writing files is ``utils.checkpoint.files``; the model a file describes ``utils.checkpoint.model``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from utils.errors import CheckpointError
from utils.flags import split_class_names

FORMAT_VERSION = 1

KEY_FORMAT_VERSION = "format_version"
KEY_MODEL = "model_state"
KEY_MODEL_ARGS = "model_args"
KEY_MASK_VALUES = "mask_values"
KEY_ARGS = "args"
KEY_WORLD_SIZE = "world_size"
KEY_TENSOR_DIGESTS = "tensor_sha256"
KEY_INFERENCE = "inference"
# --ema runs: ``model_state`` holds the averaged weights (what validation, best.pth and inference use) and this key the
# weights being trained (what a resume continues), in every full-state file of the run, so a resume from any of them is
# exact and every reader of ``model_state`` gets the average unchanged (utils.training.step).
KEY_LIVE_MODEL = "live_model_state"
# sha256 of the run's split.json (utils.datasets.splits.SplitRecord.digest): a resume on another split is refused.
KEY_SPLIT_DIGEST = "split_sha256"
# Where the run stands (epoch, global_step, step_in_epoch, best_dice, ...): TrainPosition's fields, under their names;
# the optimizer's, scheduler's and scaler's states, the dataset's record and the RNG's: TrainingState's, likewise.

# Prefixes added by wrappers, in any order: DistributedDataParallel ("module.") and torch.compile ("_orig_mod.").
_WRAPPER_PREFIXES = re.compile(r"^(?:module\.|_orig_mod\.)+")
# Keys under which other training scripts nest the model's weights.
_NESTED_WEIGHT_KEYS = ("model_state_dict", "state_dict", "model")


@dataclass(frozen=True)
class InferenceRecord:
    """How images were prepared for the model in training, so inference prepares them the same way.

    Each field is None (or empty) when the file does not record it: milesial's and the DDP script's files never do.
    """

    scale: float | None = None
    """The resize factor of the training images (``--scale``)."""
    ignore_values: tuple[int, ...] = ()
    """Void mask values (``--ignore-value``): never a class, never predicted."""
    channels: int | None = None
    """Channels of the training images (grey photos for an RGB model are converted)."""
    class_names: tuple[str, ...] = ()
    """One name per class (``--class-names``), shown by predict's legends and evaluate's table; empty when unnamed."""

    def as_dict(self) -> dict[str, Any]:
        """The record as files hold it (its tuples as lists)."""
        return {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(self).items()}

    @classmethod
    def of(cls, raw: Mapping[str, Any]) -> InferenceRecord:
        """The record of a loaded file; files written before it existed give theirs from the run's ``args``.

        The one place that reads the command-line ``args`` for inference; values that are not usable (a crafted or
        damaged file) are dropped rather than trusted.
        """
        record = raw.get(KEY_INFERENCE)
        if not isinstance(record, Mapping):  # the run's flags have the record's names; the channels are the model's
            run_args, model_args = (raw.get(key) for key in (KEY_ARGS, KEY_MODEL_ARGS))
            record = {
                **(run_args if isinstance(run_args, Mapping) else {}),
                "channels": model_args.get("n_channels") if isinstance(model_args, Mapping) else None,
            }
        scale, channels, names = record.get("scale"), record.get("channels"), record.get("class_names")
        if isinstance(names, str):  # a run's args hold the flag's text ("background,car"); the record holds the list
            names = split_class_names(names)
        usable_scale = isinstance(scale, int | float) and not isinstance(scale, bool) and 0 < scale <= 1
        return cls(
            scale=float(scale) if usable_scale else None,
            ignore_values=_tuple_of(record.get("ignore_values"), int),
            channels=channels if type(channels) is int and channels >= 1 else None,  # a bool is no channel count
            class_names=_tuple_of(names, str),
        )


def _tuple_of(values: Any, kind: type) -> tuple:
    """``values`` as a tuple when they are a list or tuple of ``kind`` exactly (a bool is no int here), else empty."""
    usable = isinstance(values, list | tuple) and all(type(value) is kind for value in values)
    return tuple(values) if usable else ()


@dataclass
class LoadedWeights:
    """Model weights read from any accepted checkpoint format."""

    state_dict: dict[str, torch.Tensor]
    model_args: dict[str, Any] | None
    mask_values: list | None
    inference: InferenceRecord
    split_digest: str | None = None
    """sha256 of the split the weights were trained on (``KEY_SPLIT_DIGEST``), when the file records it."""


def tensor_digests(payload: Mapping[str, Any]) -> dict[str, str]:
    """sha256 (with dtype and shape) of every tensor of ``payload``, keyed by its path (``model_state/inc...``)."""
    return {name: _tensor_sha256(tensor) for name, tensor in _tensors_of(payload)}


def verify_checkpoint(raw: Mapping[str, Any], path: str | Path) -> None:
    """Refuse a file of a newer format version, one whose tensors changed since the save (digest), or one whose model
    weights are not usable (``_check_weight_values``): every read passes here (weights, --resume, run-folder scans)."""
    version = raw.get(KEY_FORMAT_VERSION, FORMAT_VERSION)  # foreign files (milesial's, the DDP script's) have none
    if type(version) is not int or version > FORMAT_VERSION:  # a newer layout is never half-understood
        raise CheckpointError(
            f"checkpoint {path} has format version {version!r}; this version of unet-ddp reads up to "
            f"{FORMAT_VERSION}. Upgrade unet-ddp"
        )
    recorded = raw.get(KEY_TENSOR_DIGESTS)
    if KEY_FORMAT_VERSION in raw and not isinstance(recorded, Mapping):
        # Every file of our format is written with its digests (save_checkpoint_atomic): one without them was edited
        # by other code, which may have changed the tensors too. A file of ours is verified, or not read as ours.
        raise CheckpointError(
            f"checkpoint {path} is in unet-ddp's format ({KEY_FORMAT_VERSION} {raw[KEY_FORMAT_VERSION]!r}) but its "
            f"tensor digests ({KEY_TENSOR_DIGESTS}) were removed or are unreadable, so its weights cannot be verified; "
            f"use another checkpoint, or if you trust it, save its weights alone with torch.save(state_dict, ...) and "
            f"load that"
        )
    if isinstance(recorded, Mapping):  # foreign files carry none
        actual = tensor_digests(raw)
        changed = sorted(name for name in set(recorded) | set(actual) if recorded.get(name) != actual.get(name))
        if changed:
            raise CheckpointError(
                f"checkpoint {path} is damaged: {len(changed)} tensor(s) differ from what was saved (e.g. "
                f"{changed[0]}), its bytes changed on disk; use another checkpoint"
            )
    _check_weight_values(_model_weights(raw), path)


def _check_weight_values(weights: Any, path: str | Path) -> None:
    """The one check of a file's model weights (checkpoints and ``--encoder-weights`` alike): finite, dense, floating
    point (integer weights give an all-background mask that looks like a result), BatchNorm variances non-negative (a
    negative one is the square root of a negative number: NaN)."""
    items = weights.items() if isinstance(weights, Mapping) else ()
    tensors = {name: tensor for name, tensor in items if isinstance(tensor, torch.Tensor)}
    if not all_finite(tensors.values()):
        name = next(name for name, tensor in tensors.items() if not all_finite([tensor]))
        raise CheckpointError(
            f"checkpoint {path} holds NaN or inf weights ({name}): the file is damaged; take an earlier checkpoint"
        )
    problem = next(filter(None, (_weight_problem(key, tensor) for key, tensor in tensors.items())), None)
    if problem is not None:
        raise CheckpointError(
            f"checkpoint {path} holds {problem}; the file is damaged or was converted wrongly, use another checkpoint"
        )


def _weight_problem(key: str, tensor: torch.Tensor) -> str | None:
    """Why the weight ``key`` cannot have come from training, None when it can."""
    if tensor.layout != torch.strided:
        return f"{key} as a {tensor.layout} tensor, not a dense one: model weights are dense"
    if not tensor.is_floating_point() and not key.endswith("num_batches_tracked"):  # BatchNorm's step counter
        return f"{key} as {tensor.dtype}, not floating point: such weights cannot have been trained"
    if key.endswith("running_var") and tensor.numel() and bool((tensor < 0).any()):
        return f"a negative BatchNorm variance in {key} (min {float(tensor.min()):g}), which no training produces"
    return None


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True when no floating-point tensor of ``tensors`` holds NaN or inf; one host synchronisation in all.

    The one finite-weights check: the trainer before a save, every checkpoint read. NaN and inf propagate through a
    sum, and a float64 sum of finite float32/16 values cannot overflow, so one number per tensor is checked instead
    of a boolean mask as large as the tensor (``torch.isfinite(tensor).all()``).
    """
    sums = [tensor.detach().sum(dtype=torch.float64) for tensor in tensors if tensor.is_floating_point()]
    return bool(torch.isfinite(torch.stack(sums)).all()) if sums else True


def _is_ours(raw: Mapping[str, Any]) -> bool:
    return KEY_MODEL in raw and KEY_FORMAT_VERSION in raw


def _tensors_of(value: Any, prefix: str = "") -> Any:
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):  # the digests themselves are strings: never among the tensors
            yield from _tensors_of(value[key], f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors_of(item, f"{prefix}/{index}")


def _tensor_sha256(tensor: torch.Tensor) -> str:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    digest = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    digest.update(flat.numpy().data)
    return digest.hexdigest()


def weights_of(raw: dict[str, Any], path: str | Path) -> LoadedWeights:
    """The model weights of ``raw`` (``load_checkpoint_file``'s result for ``path``), wrapper prefixes removed."""
    state_dict, model_args = _model_weights(raw), raw.get(KEY_MODEL_ARGS) if _is_ours(raw) else None
    if not isinstance(state_dict, Mapping) or not state_dict or not all(map(torch.is_tensor, state_dict.values())):
        raise CheckpointError(f"{path} is not a model checkpoint: it holds no tensors of model weights")
    split_digest = raw.get(KEY_SPLIT_DIGEST) if _is_ours(raw) and isinstance(raw.get(KEY_SPLIT_DIGEST), str) else None
    unwrapped = {_WRAPPER_PREFIXES.sub("", key): tensor for key, tensor in state_dict.items()}
    return LoadedWeights(unwrapped, model_args, raw.get(KEY_MASK_VALUES), InferenceRecord.of(raw), split_digest)


def _model_weights(raw: Mapping[str, Any]) -> Any:
    """What ``raw`` holds as the model's weights: ours under ``KEY_MODEL``, a foreign file's where it put them."""
    if _is_ours(raw):
        return raw[KEY_MODEL]
    for key in _NESTED_WEIGHT_KEYS:
        if isinstance(raw.get(key), dict):
            return dict(raw[key])
    return {key: value for key, value in raw.items() if key != KEY_MASK_VALUES}


# The fields of numpy's state (after its generator's name, "MT19937") and of Python's, as checkpoints name them.
_NUMPY_RNG_FIELDS = ("keys", "pos", "has_gauss", "cached_gaussian")
_PYTHON_RNG_FIELDS = ("version", "state", "gauss_next")


def capture_rng_state() -> dict[str, Any]:
    """torch/CUDA/numpy/python RNG states as tensors and plain values (loadable with weights_only=True).

    Training draws no random numbers after initialisation (data order and augmentation are pure functions of the
    seed, epoch and index), so these are stored for completeness and for anything a user adds, not for exactness.
    """
    numpy_state = dict(zip(_NUMPY_RNG_FIELDS, np.random.get_state()[1:], strict=True))
    numpy_state["keys"] = torch.from_numpy(numpy_state["keys"].astype(np.int64))  # weights_only reads no numpy arrays
    python_state = dict(zip(_PYTHON_RNG_FIELDS, random.getstate(), strict=True))
    state = {"torch": torch.get_rng_state(), "numpy": numpy_state, "python": python_state}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    numpy_state = {**state["numpy"], "keys": state["numpy"]["keys"].numpy().astype(np.uint32)}
    np.random.set_state(("MT19937", *(numpy_state[name] for name in _NUMPY_RNG_FIELDS)))
    python_state = state["python"]  # files of older versions hold its state as a list
    random.setstate((python_state["version"], tuple(python_state["state"]), python_state["gauss_next"]))
    cuda_states = state.get("cuda")
    if cuda_states is not None and torch.cuda.is_available() and len(cuda_states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda_states)


# What best.pth and best-K.pth hold: the weights, what inference rebuilds the model and prepares images from, and where
# the run stood; no optimizer state (two more copies of the weights' size with AdamW), so they cannot be resumed.
WEIGHTS_ONLY_KEYS = (
    KEY_FORMAT_VERSION,
    KEY_MODEL,
    KEY_MODEL_ARGS,
    KEY_MASK_VALUES,
    KEY_INFERENCE,
    "epoch",
    "global_step",
    "best_dice",
    KEY_SPLIT_DIGEST,  # evaluate.py --split refuses another split than the weights were trained on
)
RESUME_KEYS = (KEY_MODEL, "optimizer", "scheduler", "epoch", "global_step", "step_in_epoch")
# TrainingState's optional fields stored under their own names; one that is not a dict in a file counts as absent.
_OPTIONAL_STATE = ("scaler", "dataset", "rng_state")


@dataclass
class TrainPosition:
    """Where training stands: ``epoch`` epochs fully done, plus ``step_in_epoch`` batches of the next one.

    Each field is saved under its own name: ``TrainingState.to_payload`` writes the fields as they are, ``of`` reads
    them back with the defaults of files that predate some.
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

    def rank(self, dice: float, keep: int) -> int | None:
        """Enter a validation ``dice`` of this step into the ``keep`` best (a tie ranks below the older state): its
        1-based place (the ``k`` of ``best-<k>.pth``), None when it is not among them. ``best_ranking`` becomes a new
        list, so a caller that keeps the old one can put it back."""
        place = sum(1 for entry in self.best_ranking if entry[0] >= dice)
        if place >= keep:
            return None
        self.best_ranking = [*self.best_ranking[:place], [dice, self.global_step], *self.best_ranking[place:]][:keep]
        return place + 1

    @classmethod
    def of(cls, payload: Mapping[str, Any]) -> TrainPosition:
        """The position ``payload`` records, each field as the type of its default; a key an older file lacks (or
        holds as None) keeps the default."""
        defaults = vars(cls())
        kept = {
            name: type(default)(payload[name]) for name, default in defaults.items() if payload.get(name) is not None
        }
        return cls(**kept)


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
    position: TrainPosition
    run_args: dict[str, Any]
    world_size: int
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    scaler: dict[str, Any] | None = None
    dataset: dict[str, Any] | None = None
    rng_state: dict[str, Any] | None = field(default_factory=capture_rng_state)
    """The RNG's state (``capture_rng_state``): captured when the state is made, unless given."""
    ema: dict[str, torch.Tensor] | None = None
    """--ema: the averaged weights (a state dict like ``weights.state_dict``); None when the run keeps no average."""

    def to_payload(self) -> dict[str, Any]:
        """The checkpoint dictionary (DESIGN.md, format version 1)."""
        weights = self.weights
        return {
            KEY_FORMAT_VERSION: FORMAT_VERSION,
            # With an average, model_state is the average (what inference reads) and the live weights move aside.
            KEY_MODEL: weights.state_dict if self.ema is None else self.ema,
            KEY_MODEL_ARGS: dict(weights.model_args),
            KEY_MASK_VALUES: list(weights.mask_values),
            KEY_INFERENCE: weights.inference.as_dict(),
            KEY_SPLIT_DIGEST: weights.split_digest,
            KEY_ARGS: dict(self.run_args),
            KEY_WORLD_SIZE: self.world_size,
            **{name: getattr(self, name) for name in ("optimizer", "scheduler", *_OPTIONAL_STATE)},
            **asdict(self.position),  # TrainPosition.of reads them back
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
        return cls(
            weights=weights,
            position=TrainPosition.of(payload),
            run_args=dict(run_args) if isinstance(run_args, dict) else {},
            world_size=int(payload.get(KEY_WORLD_SIZE) or 1),
            optimizer=payload["optimizer"],
            scheduler=payload["scheduler"],
            ema=ema,
            **{name: payload[name] if isinstance(payload.get(name), dict) else None for name in _OPTIONAL_STATE},
        )


def dataset_record(image_ids: Sequence[str]) -> dict[str, Any]:
    """What a checkpoint records of its dataset: the number of images and a sha256 of their sorted ids."""
    digest = hashlib.sha256("\n".join(sorted(image_ids)).encode()).hexdigest()
    return {"fingerprint": digest, "images": len(image_ids)}
