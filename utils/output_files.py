"""The one writer of every file a user reads: predicted masks and overlays, evaluate's JSON, exports, curves.png.

Two promises, kept here and nowhere else:

* **Nothing a run reads or must keep is replaced** (``check_outputs``). Outputs are compared with the inputs, the
  true masks and the checkpoint by *file identity* (device and inode, as ``os.path.samefile``), never by path string,
  so a hard link or a symbolic link to an input is caught. An existing file at an output path that is a PyTorch
  checkpoint (a ``torch.save`` archive, whatever its name) or an image inside one of the run's input folders is
  refused too, as is an existing ``.pth`` file.
* **An existing file is replaced only when asked** (``overwrite=False``: exports without ``--overwrite``), and never a
  file of a training run (``metrics.jsonl``, ``split.json``, ``config.yaml``, ``curves.png`` or anything under
  ``tensorboard/`` in a folder holding a run's ``metrics.jsonl``), whatever the flag.
* **A write is all or nothing** (``replacing``, ``write_file``). Each file is written to a temporary file in its own
  folder, flushed to disk, then renamed over the output path with ``os.replace``: a link at the output path is
  replaced, never written through, and a write that fails (a full disk) leaves the previous file whole and no
  temporary file behind.

``metrics.jsonl`` is appended to, not replaced, and never through a link: ``open_for_append`` drops a torn last line
(a crash mid-write) with one warning. A side output's folder (``side_output_folder``: TensorBoard's) is never a link
or a file in the way, and a side output that cannot be written is one warning (its caller's): the run goes on
without it.

The small text files a user hands back (``--config``'s YAML, ``--split``'s JSON) are read here too, bounded in size
and as UTF-8, each failure one line (``read_text``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import pickle
import secrets
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO

from utils.datasets.image_files import IMAGE_EXTENSIONS, OUTPUT_SUFFIX, VIZ_SUFFIX
from utils.errors import ConfigError, UserError

logger = logging.getLogger(__name__)

# Errors of the output location rather than of one file: every later write would fail the same way.
LOCATION_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG})
# torch.save's legacy (non-zip) format starts with this pickled magic number.
_LEGACY_TORCH_MAGIC = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)[:-1]

FileKey = tuple[int, int]

# The files of a training run folder (``utils.checkpoint.run_folder.RunFolder``) that no other output may replace.
RUN_FILE_NAMES = ("metrics.jsonl", "split.json", "config.yaml", "curves.png")
RUN_MARKER = "metrics.jsonl"


class OutputError(UserError):
    """An output could not be written; ``location_failure`` when the folder or disk refuses every write."""

    def __init__(self, message: str, *, location_failure: bool) -> None:
        super().__init__(message)
        self.location_failure = location_failure


def file_key(path: Path) -> FileKey | None:
    """The identity (device, inode) of the file ``path`` names, through links; ``None`` when there is none."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino


def torch_archive_kind(path: Path) -> str | None:
    """``"checkpoint"`` for a ``torch.save`` file, ``"torchscript"`` for a TorchScript archive, else ``None``."""
    try:
        with open(path, "rb") as handle:
            if handle.read(len(_LEGACY_TORCH_MAGIC)) == _LEGACY_TORCH_MAGIC:
                return "checkpoint"
            names = zipfile.ZipFile(handle).namelist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return None
    if not any(name == "data.pkl" or name.endswith("/data.pkl") for name in names):
        return None
    # TorchScript archives carry the model's code; torch.save archives carry only pickled data.
    return "torchscript" if any("/code/" in name for name in names) else "checkpoint"


def check_outputs(
    outputs: Iterable[tuple[Path, str]],
    protected: Mapping[Path, str],
    input_folders: Iterable[Path] = (),
    *,
    writes_images: bool = True,
    replaces_torchscript: bool = False,
    overwrite: bool | None = None,
) -> None:
    """Raise ``ConfigError`` naming both files when an output would replace something a run must keep.

    ``outputs`` pairs each output path with what it is (``"the mask of in/a.png"``, ``"--json"``); ``protected``
    maps each file the run reads (inputs, true masks, the checkpoint) to its role. Refused: an output that is a
    protected file (same device and inode, through hard or symbolic links); two outputs that are one file; an existing
    ``.pth`` or ``torch.save`` file (a checkpoint under any name); an existing TorchScript archive unless
    ``replaces_torchscript`` (an export replacing an earlier export); an existing image inside one of
    ``input_folders`` other than an earlier output (``*_OUT``/``*_VIZ``); any existing image when the outputs are not
    images (``writes_images=False``: JSON, exports); a file of a training run (``run_file_role``); with
    ``overwrite=False``, any existing file (the message names ``--overwrite``).
    """
    kept = {key: f"which is {role} {path}" for path, role in protected.items() if (key := file_key(path)) is not None}
    folders = set(map(file_key, input_folders)) - {None}
    written: dict[object, str] = {}
    for path, role in outputs:
        key = file_key(path)
        clash = kept.get(key) if key is not None else None
        if clash is None and (key is not None or os.path.islink(path)):
            clash = run_file_role(path)
        # --overwrite replaces an export's earlier file, never a checkpoint, an image or a run's file.
        overwritable = False
        if clash is None and key is not None:
            clash, overwritable = _existing_file(path, folders, writes_images, replaces_torchscript)
            if clash is None and overwrite is False:
                clash, overwritable = "an existing file", True
        if clash is not None:
            fix = "choose another name"
            if overwritable and overwrite is False:
                fix = f"add --overwrite to replace it, or {fix}"
            raise ConfigError(f"{role} would be written to {path}, {clash}; {fix}")
        # Where a file not yet written will be: its folder's identity and its name (the folder may not exist yet).
        folder = file_key(path.parent)
        slot = key if key is not None else (folder, path.name) if folder is not None else str(path.resolve())
        if slot in written:
            raise ConfigError(f"{written[slot]} and {role} would both be written to {path}; rename one or use --output")
        written[slot] = role


def run_file_role(path: Path) -> str | None:
    """What ``path`` is when it is a file of a training run (see ``RUN_FILE_NAMES``), through links; else ``None``."""
    path = Path(os.path.realpath(path))
    for folder in (path.parent, *path.parents):
        if (folder / RUN_MARKER).is_file():
            if folder == path.parent and path.name in RUN_FILE_NAMES:
                return f"the run file {path.name} of the training run {folder}"
            if folder != path.parent and path.relative_to(folder).parts[0] == "tensorboard":
                return f"a TensorBoard file of the training run {folder}"
            return None
    return None


def _existing_file(
    path: Path, input_folders: set[FileKey | None], writes_images: bool, replaces_torchscript: bool
) -> tuple[str | None, bool]:
    """What the existing file at output ``path`` is when no output may replace it (None when one may), and whether
    an export's ``--overwrite`` may."""
    kind = torch_archive_kind(path)
    if path.suffix.lower() == ".pth" or kind == "checkpoint":
        return "an existing checkpoint", False
    if kind == "torchscript":  # an earlier export may be replaced (a .pt TorchScript file is no dataset tensor)
        return None if replaces_torchscript else "an existing TorchScript model", True
    if path.suffix.lower() not in IMAGE_EXTENSIONS:
        return None, False
    if not writes_images:
        return "an existing image", False
    folders = {file_key(path.parent), file_key(path.resolve().parent)}
    if not path.stem.endswith((OUTPUT_SUFFIX, VIZ_SUFFIX)) and folders & input_folders:
        return "an existing image in an input folder", False
    return None, False


@contextlib.contextmanager
def replacing(path: Path, role: str | None = None, *, durable: bool = True, keep_suffix: bool = True) -> Iterator[Path]:
    """A temporary path next to ``path`` to write into; on leaving the block it is flushed and renamed onto ``path``
    (without ``durable``, renamed only: no fsync of the file or its folder, for a cache whose lost entry costs a
    re-decode).

    If the block raises, the temporary file is removed and ``path`` is left as it was. The temporary name keeps the
    suffix (PIL and exporters choose the format by it) and starts with a dot (folder inputs skip hidden files);
    without ``keep_suffix`` it ends in ``.tmp`` instead (``.last.pth.<random>.tmp``: a checkpoint's, which nothing
    that takes ``*.pth`` files may mistake for one; ``utils.checkpoint.run_folder.PARTIAL_FILE_PATTERN``).
    The folder is created if missing (``--json``, ``--export`` may name a new one). OS errors become ``OutputError``
    naming ``role`` (or the path) and the fix, raised from the ``OSError``.
    """
    path, token = Path(path), secrets.token_hex(4)
    temporary = path.with_name(f".{path.stem}.{token}.tmp{path.suffix}" if keep_suffix else f".{path.name}.{token}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # O_EXCL: never reuse a name; mode 0o666 lets the umask give the file the permissions of any new file.
        os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as error:
        raise _output_error(path, role, error) from error
    try:
        yield temporary
        if durable:
            with open(temporary, "rb") as handle:
                os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        temporary.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise _output_error(path, role, error) from error
        raise
    if durable:  # the rename itself made durable: the folder's entry on disk (a folder that cannot be, as it is)
        with contextlib.suppress(OSError):
            descriptor = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)


def write_file(path: Path, write: Callable[[Path], object], role: str | None = None) -> None:
    """Write ``path`` all or nothing: ``write`` receives a temporary path in the same folder (see ``replacing``)."""
    with replacing(path, role) as temporary:
        write(temporary)


def write_text(path: Path, text: str, role: str | None = None) -> None:
    """``path.write_text(text)``, all or nothing."""
    write_file(path, lambda temporary: temporary.write_text(text, encoding="utf-8"), role)


def read_text(path: Path, where: str, max_bytes: int, too_large: str) -> str:
    """The UTF-8 text of a small file a user hands back (a run's ``config.yaml`` or ``split.json``), reading at most
    ``max_bytes`` of it, so a wrong path (a dataset, a device) costs nothing.

    Every failure is one ``ConfigError`` that starts with ``where`` (the flag and the path); a larger file's says
    "is larger than ``too_large``" (the limit and what to pass instead).
    """
    try:
        with open(path, "rb") as handle:
            data = handle.read(max_bytes + 1)
    except OSError as error:
        raise ConfigError(f"{where}: cannot read it ({error.strerror or error})") from error
    if len(data) > max_bytes:
        raise ConfigError(f"{where} is larger than {too_large}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{where} is not UTF-8 text (byte {error.start}); save it as UTF-8") from None


def open_for_append(path: Path) -> IO[str]:
    """``path`` opened to append lines. A torn last line (a crash mid-write) is repaired first, with one warning: a
    whole JSON object that lost only its newline gets it back, anything else is cut off, so readers never meet it.
    A link at ``path`` is refused (``OutputError``): its target, an input say, would get the records."""
    _refuse_link(path, "the run's metrics.jsonl")
    with open(path, "a+b") as raw:
        start, tail = 0, b""
        if size := raw.seek(0, os.SEEK_END):
            # The last newline found in the mapped file: only the tail is read, however long the file.
            with mmap.mmap(raw.fileno(), 0, access=mmap.ACCESS_READ) as content:
                start = content.rfind(b"\n", 0, size - 1) + 1
                tail = content[start:]
        if tail and not tail.endswith(b"\n"):
            try:
                whole = isinstance(json.loads(tail), dict)  # a torn record can still parse, as a number say
            except ValueError:
                whole = False
            if whole:
                raw.write(b"\n")
                logger.warning("%s ended without a newline (a crash while writing); the line is ended", path)
            else:
                raw.truncate(start)
                logger.warning(
                    "%s ended in a torn line of %d bytes (a crash while writing); it is dropped", path, len(tail)
                )
            raw.flush()
            os.fsync(raw.fileno())
    return open(path, "a", encoding="utf-8")  # noqa: SIM115 - the caller closes it


def side_output_folder(folder: Path, role: str) -> Path:
    """``folder`` made ready for a side output's files (TensorBoard's events), or ``OutputError`` saying why not.

    The folder must be a real folder inside the run's own folder: a symbolic link is refused (its files would land
    wherever it points, an input folder say), as is a file in the way. A probe file proves the folder writable, so
    an unwritable one is found here, not by a writer thread later.
    """
    _refuse_link(folder, role)
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"{role}: {folder} is a file, not a folder; move it away", location_failure=False)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe.{secrets.token_hex(4)}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        probe.unlink()
    except OSError as error:
        raise _output_error(folder, role, error) from error
    return folder


def _refuse_link(path: Path, role: str) -> None:
    if path.is_symlink():
        raise OutputError(
            f"{role}: {path} is a link to {os.path.realpath(path)}; a run writes only inside its own folder: "
            "remove the link",
            location_failure=False,
        )


def _output_error(path: Path, role: str | None, error: OSError) -> OutputError:
    what = f"{role} to {path}" if role else str(path)
    location = error.errno in LOCATION_ERRNOS
    if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        fix = "free some space there or write the outputs elsewhere"
    else:
        fix = "choose a folder you can write to" if location else "check the output path"
    return OutputError(f"cannot write {what}: {error.strerror or error}; {fix}", location_failure=location)
