"""Checkpoint files on disk: atomic writes and the one safe read every other read goes through.

Writes go to a temporary file in the same folder, are fsynced and then renamed over the final name (the one atomic
writer of outputs, ``utils.output_files.replacing``), so a file under a final name is always complete, whatever
moment a crash happens. A state saved under several names is serialised once and its bytes copied
(``copy_checkpoint_atomic``): every name is a file of its own, so writing into one name in place never changes
another. Files get the mode any file the user creates gets (0666 minus the umask).

Reads always use ``weights_only=True``: a checkpoint can hold tensors, numbers, strings and containers, never objects
whose unpickling runs code (``utils.errors.refused_code`` names the code a refused file would import, as torch's
refusal does, without its advice to load the file unsafely). Every read checks the format version, the digests and
the weights' values (``utils.checkpoint.format``).
"""

from __future__ import annotations

import pickle
import re
import shutil
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from utils.checkpoint.format import (
    KEY_FORMAT_VERSION,
    KEY_TENSOR_DIGESTS,
    LoadedWeights,
    TrainingState,
    tensor_digests,
    verify_checkpoint,
    weights_of,
)
from utils.errors import CheckpointError, refused_code
from utils.output_files import OutputError, replacing


def save_checkpoint_atomic(payload: Mapping[str, Any], path: str | Path, *copies: str | Path) -> None:
    """Write ``payload`` to ``path`` so that ``path`` is either the old file or the complete new one; each of
    ``copies`` then gets its bytes (``copy_checkpoint_atomic``): a state saved under several names is serialised once.

    Raises CheckpointError (naming the folder and the fix) when the disk is full or the folder is not writable; the
    previous file under ``path`` is then untouched.
    """
    if KEY_FORMAT_VERSION in payload:
        payload = {**payload, KEY_TENSOR_DIGESTS: tensor_digests(payload)}
    _write_atomic(Path(path), lambda temporary: _save_to(payload, temporary))
    for copy in copies:
        copy_checkpoint_atomic(path, copy)


def copy_checkpoint_atomic(source: str | Path, target: str | Path) -> None:
    """``target`` becomes a separate file with the bytes of ``source`` (just written), atomically like a save.

    Copying the written bytes costs far less than serialising the payload again (no pickling, no tensor copies), and
    ``shutil.copyfile`` copies them inside the kernel.
    """
    _write_atomic(Path(target), lambda temporary: shutil.copyfile(source, temporary))


def write_failure_message(path: str | Path, error: OSError) -> str:
    """What a failed write into a run folder says, at start (lock file) or during a save: the file and the fix."""
    return (
        f"could not write {path}: {error.strerror or error}. The previous file (if any) is intact; free disk space, "
        f"fix the permissions of {Path(path).parent} or choose another --checkpoint-dir"
    )


def _write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    # A temporary name that ends in .tmp: run_folder.PARTIAL_FILE_PATTERN, which a run folder's start-up clears.
    try:
        with replacing(path, keep_suffix=False) as temporary:
            write(temporary)
    except OutputError as error:
        # Raised from the OSError; a run folder's write failure names --checkpoint-dir as its fix.
        raise CheckpointError(write_failure_message(path, error.__cause__)) from error.__cause__


def write_run_text(path: Path, text: str) -> None:
    """A run folder's small text file (``split.json``, ``config.yaml``), all or nothing; a failure is a failed save's
    one line (the file, the reason, ``--checkpoint-dir``)."""
    _write_atomic(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def _save_to(payload: Mapping[str, Any], temporary: Path) -> None:
    with open(temporary, "wb") as handle:
        try:
            torch.save(dict(payload), handle)
        except RuntimeError as error:
            # torch reports a failed write (disk full, file too large) as a RuntimeError about the zip writer's
            # position, raised while the OSError of the failed write was being handled: that one says what happened.
            if not isinstance(error.__context__, OSError):
                raise
            raise error.__context__ from error


def load_checkpoint_file(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint safely, to the CPU; every way a file can be unusable becomes a CheckpointError naming it."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; check the path given to --load/--model/--resume")
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a folder; give the path of a .pth file inside it")
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes), probably from an interrupted copy; use another")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # Only a GLOBAL reference (a class or function to import) can run code; other refusals are just bad bytes.
        refusal = refused_code(error)
        if refusal is not None:
            raise CheckpointError(
                f"refused to load {path}: {refusal}. If you trust its source, re-save its weights with "
                "torch.save(model.state_dict(), ...)"
            ) from error
        # torch's words without its advice to load the file unsafely: the operand it stopped at.
        reason = re.search(r"WeightsUnpickler error:\s*(.*?)\s*(?:Check the documentation|$)", str(error), re.DOTALL)
        operand = f" ({' '.join(reason.group(1).split())})" if reason and reason.group(1) else ""
        raise CheckpointError(f"checkpoint {path} is corrupt or not a PyTorch file{operand}; use another") from error
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError, IndexError, KeyError) as error:
        raise CheckpointError(
            f"checkpoint {path} is corrupt or truncated ({type(error).__name__}); use another checkpoint"
        ) from error
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a checkpoint dictionary")
    verify_checkpoint(obj, path)
    return obj


def read_model_weights(path: str | Path) -> LoadedWeights:
    """Model weights from our checkpoints, milesial/Pytorch-UNet files or the documented DDP script's files."""
    return weights_of(load_checkpoint_file(path), path)


def load_resume_checkpoint(path: str | Path) -> TrainingState:
    """The state of a checkpoint that holds everything needed to continue training, else a CheckpointError naming
    what is missing."""
    return TrainingState.of(load_checkpoint_file(path), path)
