"""The one checkpoint format: its key constants, the records it holds, its digests and the formats users bring.

Our files record a sha256 of every tensor (``KEY_TENSOR_DIGESTS``, computed once at save) and every read checks it,
so bytes changed on disk are an error naming the file, not wrong weights (a file of our format whose digests were
removed is refused too); every read also refuses NaN or inf model weights (the only check possible for foreign files,
which carry no digests) and checks the format version. Foreign files: milesial/Pytorch-UNet's bare ``state_dict``,
``module.``/``_orig_mod.`` prefixes of wrapped models, and the DDP script's ``model_state_dict``.

What inference needs to prepare images (the training scale, the void mask values, the image channels) is its own
record (``KEY_INFERENCE``, ``InferenceRecord``), written at save time, so renaming a training flag can never change
how predict resizes; files written before the record existed are read from their ``args`` in one place
(``InferenceRecord.of``). Reading and writing files is ``utils.checkpoint.files``; the training state
``utils.checkpoint.state``; the model a file describes ``utils.checkpoint.model``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from utils.errors import CheckpointError
from utils.flags import split_class_names

FORMAT_VERSION = 1

KEY_FORMAT_VERSION = "format_version"
KEY_MODEL = "model_state"
KEY_MODEL_ARGS = "model_args"
KEY_MASK_VALUES = "mask_values"
KEY_OPTIMIZER = "optimizer"
KEY_SCHEDULER = "scheduler"
KEY_SCALER = "scaler"
KEY_EPOCH = "epoch"
KEY_GLOBAL_STEP = "global_step"
KEY_STEP_IN_EPOCH = "step_in_epoch"
KEY_RNG = "rng_state"
KEY_ARGS = "args"
KEY_BEST_DICE = "best_dice"
KEY_BEST_RANKING = "best_ranking"
KEY_WORLD_SIZE = "world_size"
KEY_DATASET = "dataset"
KEY_TENSOR_DIGESTS = "tensor_sha256"
KEY_INFERENCE = "inference"
# --ema runs: ``model_state`` holds the averaged weights (what validation, best.pth and inference use) and this key the
# weights being trained (what a resume continues), in every full-state file of the run, so a resume from any of them is
# exact and every reader of ``model_state`` gets the average unchanged (utils.training.ema).
KEY_LIVE_MODEL = "live_model_state"
# --patience: the epoch of best_dice and the validations since the last improvement (utils.training.early_stop).
KEY_BEST_EPOCH = "best_epoch"
KEY_VALIDATIONS_WITHOUT_IMPROVEMENT = "validations_without_improvement"
# sha256 of the run's split.json (utils.datasets.splits.SplitRecord.digest): a resume on another split is refused.
KEY_SPLIT_DIGEST = "split_sha256"

# Names of files being written: ``.<final name>.<random>.tmp`` beside the final name. A crash can leave one behind
# (never under a final name); ``RunFolder.remove_partial_files`` clears them when the next run takes the folder's lock.
PARTIAL_FILE_PATTERN = re.compile(r"^\..+\.pth\.[A-Za-z0-9_]+\.tmp$")

# Prefixes added by wrappers: DistributedDataParallel ("module.") and torch.compile ("_orig_mod.").
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
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
        if not isinstance(record, Mapping):
            run_args = raw.get(KEY_ARGS)
            run_args = run_args if isinstance(run_args, Mapping) else {}
            model_args = raw.get(KEY_MODEL_ARGS)
            channels = model_args.get("n_channels") if isinstance(model_args, Mapping) else None
            record = {
                "scale": run_args.get("scale"),
                "ignore_values": run_args.get("ignore_values"),
                "channels": channels,
                "class_names": run_args.get("class_names"),
            }
        return cls(
            scale=_usable_scale(record.get("scale")),
            ignore_values=_usable_tuple(record.get("ignore_values"), _is_int),
            channels=_usable_channels(record.get("channels")),
            class_names=_usable_names(record.get("class_names")),
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _usable_scale(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        return None
    return float(value)


def _usable_tuple(values: Any, usable: Callable[[Any], bool]) -> tuple:
    """``values`` as a tuple when they are a list or tuple of usable items, else empty."""
    if not isinstance(values, list | tuple) or not all(usable(value) for value in values):
        return ()
    return tuple(values)


def _usable_channels(value: Any) -> int | None:
    return value if _is_int(value) and value >= 1 else None


def _usable_names(values: Any) -> tuple[str, ...]:
    # A run's args hold the flag's text ("background,car"); the record holds the list.
    if isinstance(values, str):
        return split_class_names(values)
    return _usable_tuple(values, lambda value: isinstance(value, str))


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
    """Refuse a file whose tensors changed since the save (digest) or whose model weights are NaN or inf."""
    recorded = raw.get(KEY_TENSOR_DIGESTS)
    if recorded is None and KEY_FORMAT_VERSION in raw:
        # Every file of our format is written with its digests (save_checkpoint_atomic): one without them was edited
        # by other code, which may have changed the tensors too. A file of ours is verified, or not read as ours.
        raise CheckpointError(
            f"checkpoint {path} is in unet-ddp's format ({KEY_FORMAT_VERSION} {raw[KEY_FORMAT_VERSION]!r}) but its "
            f"tensor digests ({KEY_TENSOR_DIGESTS}) were removed, so its weights cannot be verified; use another "
            f"checkpoint, or if you trust it, save its weights alone with torch.save(state_dict, ...) and load that"
        )
    if recorded is not None:
        if not isinstance(recorded, Mapping):
            raise CheckpointError(f"checkpoint {path} is damaged (its tensor digests are unreadable); use another")
        actual = tensor_digests(raw)
        changed = sorted(name for name in set(recorded) | set(actual) if recorded.get(name) != actual.get(name))
        if changed:
            raise CheckpointError(
                f"checkpoint {path} is damaged: {len(changed)} tensor(s) differ from what was saved (e.g. "
                f"{changed[0]}), its bytes changed on disk; use another checkpoint"
            )
    weights = _model_weights(raw)
    items = weights.items() if isinstance(weights, Mapping) else ()
    tensors = [(name, tensor) for name, tensor in items if isinstance(tensor, torch.Tensor)]
    if not all_finite(tensor for _, tensor in tensors):
        name = next(name for name, tensor in tensors if not all_finite([tensor]))
        raise CheckpointError(
            f"checkpoint {path} holds NaN or inf weights ({name}): the file is damaged; take an earlier checkpoint"
        )


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
        for key in sorted(value, key=str):
            if prefix == "" and key == KEY_TENSOR_DIGESTS:
                continue
            yield from _tensors_of(value[key], f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors_of(item, f"{prefix}/{index}")


def _tensor_sha256(tensor: torch.Tensor) -> str:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    digest = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    digest.update(flat.numpy().data)
    return digest.hexdigest()


def check_format_version(raw: Mapping[str, Any], path: str | Path) -> None:
    # Every read passes here (weights, --resume, run-folder scans): a newer layout is never half-understood.
    if KEY_FORMAT_VERSION not in raw:
        return  # a foreign file (milesial's, the DDP script's): no version to check
    version = raw[KEY_FORMAT_VERSION]
    if not _is_int(version) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {version!r}; this version of unet-ddp reads up to "
            f"{FORMAT_VERSION}. Upgrade unet-ddp"
        )


def weights_of(raw: dict[str, Any], path: str | Path) -> LoadedWeights:
    """The model weights of ``raw`` (``load_checkpoint_file``'s result for ``path``), wrapper prefixes removed."""
    state_dict, model_args = _model_weights(raw), raw.get(KEY_MODEL_ARGS) if _is_ours(raw) else None
    if not isinstance(state_dict, Mapping) or not state_dict or not all(map(torch.is_tensor, state_dict.values())):
        raise CheckpointError(f"{path} is not a model checkpoint: it holds no tensors of model weights")
    mask_values = raw.get(KEY_MASK_VALUES)
    split_digest = raw.get(KEY_SPLIT_DIGEST) if _is_ours(raw) and isinstance(raw.get(KEY_SPLIT_DIGEST), str) else None
    return LoadedWeights(
        _strip_wrapper_prefixes(state_dict), model_args, mask_values, InferenceRecord.of(raw), split_digest
    )


def _model_weights(raw: Mapping[str, Any]) -> Any:
    """What ``raw`` holds as the model's weights: ours under ``KEY_MODEL``, a foreign file's where it put them."""
    if _is_ours(raw):
        return raw[KEY_MODEL]
    for key in _NESTED_WEIGHT_KEYS:
        if isinstance(raw.get(key), dict):
            return dict(raw[key])
    return {key: value for key, value in raw.items() if key != KEY_MASK_VALUES}


def _strip_wrapper_prefixes(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    cleaned = {}
    for key, value in state_dict.items():
        for prefix in _WRAPPER_PREFIXES:
            while key.startswith(prefix):
                key = key[len(prefix) :]
        cleaned[key] = value
    return cleaned
