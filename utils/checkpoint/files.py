"""Checkpoint files on disk: atomic writes and the one safe read every other read goes through.

Writes go to a temporary file in the same folder, are fsynced and then renamed over the final name (the one atomic
writer of outputs, ``utils.output_files.replacing``), so a file under a final name is always complete, whatever
moment a crash happens. A state saved under several names is serialised once and its bytes copied
(``copy_checkpoint_atomic``): every name is a file of its own, so writing into one name in place never changes
another. Files get the mode any file the user creates gets (0666 minus the umask).

Reads always use ``weights_only=True``: a checkpoint can hold tensors, numbers, strings and containers, never objects
whose unpickling runs code (``utils.checkpoint.pickle_scan`` names the code a refused file would import). Every read
checks the format version, the digests and the weights' values (``utils.checkpoint.format``).
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from utils.checkpoint.format import (
    KEY_FORMAT_VERSION,
    KEY_TENSOR_DIGESTS,
    LoadedWeights,
    check_format_version,
    tensor_digests,
    verify_checkpoint,
    weights_of,
)
from utils.checkpoint.pickle_scan import code_refusal, pickled_code, without_unsafe_advice
from utils.errors import CheckpointError
from utils.output_files import OutputError, replacing

# copy_file_range refusals after which plain reads and writes do the copy.
_NO_COPY_RANGE_ERRNOS = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF}


def save_checkpoint_atomic(payload: Mapping[str, Any], path: str | Path) -> None:
    """Write ``payload`` to ``path`` so that ``path`` is either the old file or the complete new one.

    Raises CheckpointError (naming the folder and the fix) when the disk is full or the folder is not writable; the
    previous file under ``path`` is then untouched.
    """
    payload = dict(payload)
    if KEY_FORMAT_VERSION in payload:
        payload[KEY_TENSOR_DIGESTS] = tensor_digests(payload)
    _write_atomic(Path(path), lambda handle: _save_to(payload, handle))


def copy_checkpoint_atomic(source: str | Path, target: str | Path) -> None:
    """``target`` becomes a separate file with the bytes of ``source`` (just written), atomically like a save.

    Copying the written bytes costs far less than serialising the payload again (no pickling, no tensor copies), and
    ``os.copy_file_range`` lets the filesystem share or copy the blocks itself.
    """

    def copy(handle: BinaryIO) -> None:
        with open(source, "rb") as original:
            _copy_bytes(original, handle)

    _write_atomic(Path(target), copy)


def write_failure_message(path: str | Path, error: OSError) -> str:
    """What a failed write into a run folder says, at start (lock file) or during a save: the file and the fix."""
    return (
        f"could not write {path}: {error.strerror or error}. The previous file (if any) is intact; free disk space, "
        f"fix the permissions of {Path(path).parent} or choose another --checkpoint-dir"
    )


def _write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    # A temporary name that ends in .tmp: format.PARTIAL_FILE_PATTERN, which a run folder's start-up clears.
    try:
        with replacing(path, keep_suffix=False) as temporary, open(temporary, "wb") as handle:
            write(handle)
    except OutputError as error:
        # Raised from the OSError; a run folder's write failure names --checkpoint-dir as its fix.
        raise CheckpointError(write_failure_message(path, error.__cause__)) from error.__cause__


def _copy_bytes(source: BinaryIO, target: BinaryIO) -> None:
    size, copied = os.fstat(source.fileno()).st_size, 0
    try:
        while copied < size and (chunk := os.copy_file_range(source.fileno(), target.fileno(), size - copied)):
            copied += chunk
    except (AttributeError, OSError) as error:
        # No copy_file_range (not Linux, old kernel, across filesystems): plain reads and writes from where it stopped.
        if isinstance(error, OSError) and error.errno not in _NO_COPY_RANGE_ERRNOS:
            raise
        source.seek(copied)
        target.seek(copied)
        shutil.copyfileobj(source, target)
        return
    if copied != size:
        raise OSError(errno.EIO, f"copied {copied} of {size} bytes")


class _WriteErrorRecorder:
    """A file wrapper that remembers the OSError of a failed write.

    ``torch.save`` into a file object reports a failed write (disk full, file too large) as a RuntimeError about the
    zip writer's position; the recorded OSError says what really happened.
    """

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self._handle.write(data)
        except OSError as error:
            self.error = self.error or error
            raise

    def flush(self) -> None:
        self._handle.flush()


def _save_to(payload: Mapping[str, Any], handle: Any) -> None:
    recorder = _WriteErrorRecorder(handle)
    try:
        torch.save(dict(payload), recorder)
    except RuntimeError as error:
        if recorder.error is None:
            raise
        raise recorder.error from error


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
        code = pickled_code(path)
        if code or "Unsupported global" in str(error) or "GLOBAL" in str(error):
            raise CheckpointError(
                f"refused to load {path}: {code_refusal(code)}. If you trust its source, re-save its weights with "
                "torch.save(model.state_dict(), ...)"
            ) from error
        reason = without_unsafe_advice(error)
        raise CheckpointError(f"checkpoint {path} is corrupt or not a PyTorch file ({reason}); use another") from error
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError, IndexError, KeyError) as error:
        raise CheckpointError(
            f"checkpoint {path} is corrupt or truncated ({type(error).__name__}); use another checkpoint"
        ) from error
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds a {type(obj).__name__}, not a checkpoint dictionary")
    check_format_version(obj, path)
    verify_checkpoint(obj, path)
    return obj


def read_model_weights(path: str | Path) -> LoadedWeights:
    """Model weights from our checkpoints, milesial/Pytorch-UNet files or the documented DDP script's files."""
    return weights_of(load_checkpoint_file(path), path)
