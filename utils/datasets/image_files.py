"""Finding, pairing and opening image and mask files, and the process pools that read many of them.

Which mask belongs to which image is decided by file names only: ``<id>.<ext>`` or Carvana's ``<id>_mask.<ext>``.

This module deliberately does not import torch at module level: the mask scan runs it in worker processes, and
importing torch there would cost seconds per worker. Only ``.pt`` files import torch, when one is opened.
"""

from __future__ import annotations

import array
import functools
import hashlib
import json
import logging
import multiprocessing
import os
import pickle
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import NamedTuple, TypeVar

import numpy as np
from PIL import Image, ImageOps

from utils.errors import ConfigError, DatasetError, refused_code

logger = logging.getLogger(__name__)

PIL_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".gif", ".bmp", ".tif", ".tiff"})
ARRAY_EXTENSIONS = frozenset({".npy", ".pt"})
# Every extension a dataset file may have, lower case; matching ignores case (``A.JPG`` counts).
IMAGE_EXTENSIONS = PIL_EXTENSIONS | ARRAY_EXTENSIONS
_EXTENSION_LIST = " ".join(sorted(IMAGE_EXTENSIONS))

# What PIL, numpy and torch.load raise on a bad file (``_load_pt`` words torch's refusals of a pickle itself). Catching
# these, and no more, turns unusable files into messages that name them while real bugs keep their tracebacks.
UNREADABLE_FILE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, RuntimeError, Image.DecompressionBombError)

CARVANA_MASK_SUFFIX = "_mask"
# How many problem files a message names before it just counts them.
MAX_NAMED_FILES = 5
# Below this many files a process pool costs more to start than it saves.
MIN_FILES_FOR_POOL = 32
MAX_DEFAULT_WORKERS = 8

# Channel counts an HxWxC array may have: grey, RGB, RGBA.
_CHANNEL_COUNTS = (1, 3, 4)
EXIF_ORIENTATION_TAG = 0x0112
# EXIF orientations 2-8 change the pixels' layout; 5-8 swap width and height.
_ROTATING_ORIENTATIONS = frozenset(range(2, 9))
_TRANSPOSING_ORIENTATIONS = frozenset({5, 6, 7, 8})

# Name endings of predict.py's outputs (``<name>_OUT.png`` masks, ``<name>_VIZ.png`` overlays), defined here, where
# no torch is imported, so that predict's file plan and the dataset scan share them: a scan skips these files.
OUTPUT_SUFFIX = "_OUT"
VIZ_SUFFIX = "_VIZ"
PREDICTION_SUFFIXES = (OUTPUT_SUFFIX, VIZ_SUFFIX)
_T = TypeVar("_T")
_R = TypeVar("_R")
# PIL's decompression-bomb limit is one module attribute (Image.MAX_IMAGE_PIXELS): ``open_pil`` sets it aside while it
# opens a file and checks the size itself. The lock keeps two threads (predict's writer threads read true masks) from
# restoring each other's saved value.
_pil_limit_lock = threading.Lock()


class FileInfo(NamedTuple):
    """One dataset file and the stat fields that decide whether a cached scan of it is still valid.

    ``path`` is an absolute path string: a folder of 100,000 files must not cost 100,000 ``Path`` objects and
    ``abspath`` calls at every start (build a ``Path`` only for the few files a message names). A named tuple, not a
    dataclass: it is made once per directory entry, and a tuple is several times cheaper to create.
    """

    path: str
    ext: str
    """Lower-case extension, with its dot."""
    size: int
    mtime_ns: int
    inode: int
    ctime_ns: int
    """With size and mtime, what keys the caches: a changed file whose mtime was put back (``os.utime``, a copy
    with ``cp -p`` or rsync ``-t``) still has a new ctime (or inode), so its cached scan or pixels are not reused."""

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @classmethod
    def of(cls, path: str | Path) -> FileInfo:
        """The record ``index_folder`` makes for the file at ``path``, so that a cache keyed by it (predict.py's
        ``--pixel-cache``) finds training's entries."""
        absolute = os.path.abspath(path)
        stat = os.stat(absolute)
        ext = os.path.splitext(absolute)[1].lower()
        return cls(absolute, ext, stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns)


def cache_key(records: Sequence[FileInfo], *settings: object) -> str:
    """The name of a cache entry made from ``records`` with ``settings`` (a format version, a scale, ...): a sha256
    of the files' paths and stat fields, so a changed, moved or replaced file never finds its old entry.

    The paths joined with NUL (which no path contains) and the stat numbers (``FileInfo``'s fields after ``path``
    and ``ext``) as one int64 array: nothing formatted per file, so the key of a 100,000-pair dataset costs tens of
    milliseconds.
    """
    digest = hashlib.sha256(json.dumps(settings).encode())
    digest.update("\0".join([info.path for info in records]).encode("utf-8", "surrogateescape"))
    digest.update(array.array("q", [number for info in records for number in info[2:]]).tobytes())
    return digest.hexdigest()


class MaskPair(NamedTuple):
    """An image and its mask; ``name`` is the image id (a named tuple: one is made per pair at every start)."""

    name: str
    image: FileInfo
    mask: FileInfo


class Finding(NamedTuple):
    """One kind of problem (or warning) in a dataset: what and how many, the first few files, and what to do."""

    kind: str
    what: str
    """With its count, e.g. ``"2 file(s) cannot be read as images"``."""
    examples: tuple[str, ...]
    fix: str

    def sentence(self) -> str:
        examples = f": {format_examples(self.examples)}" if self.examples else ""
        return f"{self.what}{examples}; {self.fix}"


class Pairing(NamedTuple):
    """The images of a folder matched with the masks of another by name (``pair_folders``)."""

    images: dict[str, FileInfo]
    """The image folder's index."""
    pairs: list[MaskPair]
    mask_suffix: str
    problems: list[Finding]
    """Images without a mask and empty files: training refuses them."""
    warnings: list[Finding]
    """Masks without an image: ignored."""


def split_name(name: str) -> tuple[str, str] | None:
    """Return ``(stem, lower-case extension)`` for a supported file name, or ``None`` if the name is not one."""
    # rpartition, not os.path.splitext: the same split for the names that get here, at a third of the cost.
    stem, dot, ext = name.rpartition(".")
    ext = "." + ext.lower()
    return (stem, ext) if dot and stem and ext in IMAGE_EXTENSIONS else None


def index_folder(folder: str | Path, role: str) -> dict[str, FileInfo]:
    """Map each file stem in ``folder`` to its file, reading the directory once.

    Hidden files (``.DS_Store``, ``._a.jpg``), sub-folders, files with other extensions and predict.py's outputs
    (``*_OUT.png``, ``*_VIZ.png``, with one warning) are ignored. ``role`` (e.g.
    ``"image"``) only words the error messages. Raises ``DatasetError`` if the folder is missing, two files share a
    stem (``a.jpg`` and ``a.png``), since either could be meant, or a link named like a file it would take leads to
    no file (a dangling link, a link loop): that file is missing, so the link is named, once, with the fix.
    """
    folder = Path(folder)
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise DatasetError(f"{role} folder {folder} {what}; point the dataset at the folder holding the files")
    files: dict[str, FileInfo] = {}
    duplicates: dict[str, list[str]] = {}
    skipped_predictions: list[str] = []
    broken_links: list[str] = []
    # One abspath per folder; each entry's path is then string concatenation (no Path, no per-file abspath).
    prefix = os.path.join(os.path.abspath(folder), "")
    with os.scandir(folder) as entries:
        for entry in entries:
            # split_name, inlined: this loop runs once per directory entry at every start.
            name = entry.name
            stem, dot, ext = name.rpartition(".")
            ext = "." + ext.lower()
            if not dot or not stem or ext not in IMAGE_EXTENSIONS or name.startswith("."):
                logger.debug("ignoring %s: not a supported %s file", entry.path, role)
                continue
            try:
                if not entry.is_file():
                    if entry.is_symlink() and not os.path.exists(entry.path):
                        broken_links.append(f"{name} -> {os.readlink(entry.path)} (no such file)")
                    continue
            except OSError as error:  # a link loop (ELOOP), or a link into a folder that cannot be read
                broken_links.append(f"{name} ({error.strerror or error})")
                continue
            if stem.endswith(PREDICTION_SUFFIXES):
                skipped_predictions.append(name)
                continue
            stat = entry.stat()
            if stem in files:
                duplicates.setdefault(stem, [files[stem].name]).append(name)
                continue
            # tuple.__new__: a named tuple's own constructor is Python code, a measurable cost per entry.
            files[stem] = tuple.__new__(
                FileInfo, (prefix + name, ext, stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns)
            )
    if skipped_predictions:
        _warn_once(
            f"ignoring {len(skipped_predictions)} file(s) in {folder} named like predict.py's outputs "
            f"(*{OUTPUT_SUFFIX}, *{VIZ_SUFFIX}), e.g. {min(skipped_predictions)}"
        )
    if broken_links:
        raise DatasetError(
            f"{len(broken_links)} link(s) in {role} folder {folder} lead to no file: "
            f"{format_examples(sorted(broken_links))}; fix or remove the link(s)"
        )
    if duplicates:
        examples = format_examples([" and ".join(sorted(names)) for _, names in sorted(duplicates.items())])
        raise DatasetError(
            f"{len(duplicates)} {role} name(s) in {folder} exist with several extensions ({examples}); "
            "keep one file per name (delete or rename the others)"
        )
    return files


@functools.cache
def _warn_once(message: str) -> None:
    """Log ``message`` once, however often the same folder is indexed (train and validation, every start)."""
    logger.warning("%s", message)


def pair_folders(images_dir: Path, mask_dir: Path, mask_suffix: str | None) -> Pairing:
    """Index both folders and pair each image with the mask named ``<id><mask_suffix>`` (``None`` detects the
    suffix: ``"_mask"`` if more images have a mask named ``<id>_mask`` than ``<id>``, else ``""``): the one pairing
    rule of the dataset and of the dataset check. A folder without images or masks, or one folder for both, is an
    error at once; the rest comes back as ``Finding``s."""
    images = index_folder(images_dir, "image")
    if not images:
        raise DatasetError(
            f"no images in {images_dir} (looked for {_EXTENSION_LIST}; hidden files and sub-folders are ignored); "
            "put the images there"
        )
    # In one folder every image would be paired with itself as its mask. Compared as files (samefile), so a link or
    # a second spelling of one folder is caught.
    if mask_dir.is_dir() and os.path.samefile(images_dir, mask_dir):
        raise ConfigError(
            f"the images ({images_dir}, --imgs) and the masks ({mask_dir}, --masks) are one folder; "
            "give the masks their own folder"
        )
    masks = index_folder(mask_dir, "mask")
    if not masks:
        raise DatasetError(f"no masks in {mask_dir} (looked for {_EXTENSION_LIST}); put one mask per image there")

    def paired(suffix: str) -> int:
        return sum(1 for name in images if name + suffix in masks)

    if mask_suffix is None:
        mask_suffix = CARVANA_MASK_SUFFIX if paired(CARVANA_MASK_SUFFIX) > paired("") else ""
    names = sorted(images)
    pairs = [MaskPair(name, images[name], mask) for name in names if (mask := masks.get(name + mask_suffix))]
    problems, warnings = [], []
    if len(pairs) < len(images):
        missing = [images[name].name for name in names if name + mask_suffix not in masks]
        what = (
            f"{len(missing)} of {len(images)} images in {images_dir} have no mask named <id>{mask_suffix}.<ext> in "
            f"{mask_dir}"
        )
        fix = "add their masks or remove those images"
        other = "" if mask_suffix == CARVANA_MASK_SUFFIX else CARVANA_MASK_SUFFIX
        if paired(other) > len(pairs):  # the other naming would pair more images
            use = "CarvanaDataset or mask_suffix='_mask'" if other else "BasicDataset with mask_suffix=''"
            fix += f" (the masks look named <id>{other}.<ext>: use {use})"
        problems.append(Finding("pairing", what, tuple(missing), fix))
    used = {name + mask_suffix for name in images}
    orphans = sorted(info.name for stem, info in masks.items() if stem not in used)
    if orphans:
        what = f"{len(orphans)} mask(s) in {mask_dir} have no image in {images_dir} and are ignored"
        warnings.append(Finding("pairing", what, tuple(orphans), "remove them or add their images"))
    empty = sorted(info.path for pair in pairs for info in (pair.image, pair.mask) if info.size == 0)
    if empty:
        what = f"{len(empty)} file(s) are empty (0 bytes), e.g. from an interrupted copy"
        problems.append(Finding("empty files", what, tuple(empty), "copy them again or delete them"))
    return Pairing(images, pairs, mask_suffix, problems, warnings)


def detect_mask_suffix(images_dir: str | Path, mask_dir: str | Path) -> str:
    """Return ``"_mask"`` if the masks are named ``<id>_mask.<ext>`` after the images, else ``""``.

    Decided by file names only (``pair_folders``): whichever naming matches more images wins, ``""`` on a tie.
    """
    return pair_folders(Path(images_dir), Path(mask_dir), None).mask_suffix


def format_examples(items: Sequence[object], limit: int = MAX_NAMED_FILES, separator: str = ", ") -> str:
    """Join the first ``limit`` items of a list (names, mask values) for a message, counting the rest."""
    shown = separator.join(map(str, items[:limit]))
    return shown if len(items) <= limit else f"{shown}{separator}... ({len(items) - limit} more)"


def pool_map(function: Callable[[_T], _R], items: Sequence[_T], workers: int | None, announce: str = "") -> list[_R]:
    """``[function(item) for item in items]``, in ``workers`` processes (default: the CPUs this process may run on,
    at most 8) when there are ``MIN_FILES_FOR_POOL`` items or more; ``announce`` (a log format taking the item and
    process counts) says so. The mask scan and the dataset check read their files through it."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    count = workers if workers is not None else min(cpus, MAX_DEFAULT_WORKERS)
    if count <= 1 or len(items) < MIN_FILES_FOR_POOL:
        return [function(item) for item in items]
    if announce:
        logger.info(announce, len(items), count)
    # Large chunks keep inter-process traffic low; several per worker keep the load balanced.
    chunksize = max(1, len(items) // (count * 8))
    # fork on Linux: workers start in milliseconds and inherit the caller's objects (DataLoader forks on Linux too);
    # spawn elsewhere. spawn/forkserver would re-import the caller's __main__ (e.g. train.py and torch) in every worker.
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with ProcessPoolExecutor(max_workers=count, mp_context=context) as pool:
        return list(pool.map(function, items, chunksize=chunksize))


def load_image(path: str | Path, *, any_size: bool = False) -> Image.Image:
    """Open an image or mask file as a PIL image.

    A file with more pixels than PIL's decompression-bomb limit (``Image.MAX_IMAGE_PIXELS``) raises ``DatasetError``
    naming it and the limit, unless ``any_size`` (predict.py ``--tile``, which never holds a whole image's
    activations).

    PIL formats are opened lazily (pixels decode on first use). A file with an EXIF orientation (a phone's JPEG) is
    turned upright as every image viewer shows it, photo and mask alike, each by its own tag (``exif_orientation``).
    ``.npy`` and ``.pt`` files hold one array, HxW or HxWxC (C in 1, 3, 4; a CxHxW tensor is accepted when only its
    first axis is a channel count), of uint8, bool (→ 0/255) or float in [0, 1] (→ 0..255); single-channel integer
    arrays (masks) keep their values.
    """
    ext = os.path.splitext(path)[1].lower()
    if ext in ARRAY_EXTENSIONS:
        # allow_pickle=False: an .npy file must hold plain numbers, never objects that could run code when loaded.
        return array_to_image(_load_pt(path) if ext == ".pt" else np.load(path, allow_pickle=False), path)
    image = open_pil(path, any_size=any_size)
    if exif_orientation(image) in _ROTATING_ORIENTATIONS:
        with image:
            return ImageOps.exif_transpose(image)
    return image


def open_pil(path: str | Path, *, any_size: bool = False) -> Image.Image:
    """``Image.open`` with PIL's pixel limit checked here: PIL only warns between its limit and twice the limit and
    raises above; here anything above the limit is one ``DatasetError`` that names the file, the limit and the fix."""
    with _pil_limit_lock:
        limit = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = None
        try:
            image = Image.open(path)
        finally:
            Image.MAX_IMAGE_PIXELS = limit
    width, height = image.size
    if not any_size and limit is not None and width * height > limit:
        image.close()
        raise DatasetError(
            f"{path} has {width}x{height} = {width * height:,} pixels, more than PIL's decompression-bomb limit of "
            f"{limit:,} (PIL.Image.MAX_IMAGE_PIXELS); downscale or split it (predict.py --tile reads images of any "
            "size)"
        )
    return image


def exif_orientation(image: Image.Image) -> int:
    """The EXIF orientation tag of an opened file (1, upright, when it has none), read from its header only.

    PNG keeps EXIF in a chunk that Pillow reads early only when it precedes the pixels; asking for it otherwise would
    decode the whole file, so a PNG without it there counts as upright.
    """
    if image.format == "PNG" and "exif" not in image.info:
        return 1
    return int(image.getexif().get(EXIF_ORIENTATION_TAG, 1) or 1)


def image_header(path: str | Path) -> tuple[int, int, int]:
    """Return ``(width, height, channels)`` of an image file as a photo loads (1 grey, 3 colour), from its header."""
    ext = os.path.splitext(path)[1].lower()
    if ext in ARRAY_EXTENSIONS:
        # For .npy, mmap reads just the header; the pixels are never touched.
        loaded = np.load(path, mmap_mode="r", allow_pickle=False) if ext == ".npy" else _load_pt(path)
        shape = _to_hwc(loaded, path).shape  # a view: moving or dropping an axis reads no pixel
        return shape[1], shape[0], 1 if len(shape) == 2 else 3
    with open_pil(path, any_size=True) as img:  # a header holds no bomb: load_image checks the size
        width, height = img.size
        if exif_orientation(img) in _TRANSPOSING_ORIENTATIONS:  # turned upright by load_image: sides swap
            width, height = height, width
        return width, height, mode_channels(img.mode)


def mode_channels(mode: str) -> int:
    """Channels a photo of PIL ``mode`` loads with: 1 for grey modes (1, L, LA, I, I;16, F: alpha dropped), 3 for every
    other mode."""
    return 1 if Image.getmodebase(mode) == "L" else 3


def array_to_image(array: np.ndarray, path: str | Path) -> Image.Image:
    """Turn an array read from ``path`` into a PIL image (see ``load_image`` for the accepted arrays)."""
    array = _to_hwc(np.asarray(array), path)
    if array.dtype == np.bool_:
        array = array.astype(np.uint8) * 255
    elif np.issubdtype(array.dtype, np.floating):
        if not np.isfinite(array).all():
            raise DatasetError(f"{path} contains NaN or infinite values; save finite values in [0, 1]")
        low, high = float(array.min()), float(array.max())
        if low < 0.0 or high > 1.0:
            raise DatasetError(
                f"{path} holds floats in [{low:g}, {high:g}]; save float images scaled to [0, 1] (or as uint8 0..255)"
            )
        array = np.rint(array.astype(np.float64) * 255.0).astype(np.uint8)
    elif array.dtype != np.uint8:
        # Integer mask values (e.g. 16-bit label maps) are kept exactly, as a 32-bit PIL image.
        if not np.issubdtype(array.dtype, np.integer) or array.ndim != 2:
            raise DatasetError(
                f"{path} holds a {array.ndim}-D {array.dtype} array; multi-channel arrays must be uint8, bool or float"
            )
        if array.min() < np.iinfo(np.int32).min or array.max() > np.iinfo(np.int32).max:
            raise DatasetError(f"{path} holds integers outside the 32-bit range; store mask values as small integers")
        array = array.astype(np.int32)
    return Image.fromarray(np.ascontiguousarray(array))


def _load_pt(path: str | Path) -> np.ndarray:
    import torch  # here, not at the top: scan workers reading image files should not pay for importing torch

    try:
        # weights_only=True refuses pickled objects other than tensors and plain containers.
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        # Not torch's message: it suggests weights_only=False, exactly what must not be done with data files.
        reason = refused_code(err) or "it is corrupt or holds objects other than tensors"
        raise DatasetError(
            f"{path} cannot be loaded safely: {reason}; save one tensor per file with torch.save"
        ) from err
    if not isinstance(loaded, torch.Tensor):
        raise DatasetError(f"{path} holds a {type(loaded).__name__}, not a tensor; save one image tensor per file")
    if loaded.is_floating_point() and loaded.dtype not in (torch.float32, torch.float64):
        loaded = loaded.float()  # numpy has no bfloat16
    return loaded.detach().numpy()


def _to_hwc(array: np.ndarray, path: str | Path) -> np.ndarray:
    """Return the array as HxW or HxWxC (C in 3, 4), moving a leading channel axis to the end (channels last wins
    when both ends could be channels); an empty array holds no image."""
    shape = array.shape
    if len(shape) == 3 and shape[2] not in _CHANNEL_COUNTS and shape[0] in _CHANNEL_COUNTS:
        array = np.moveaxis(array, 0, -1)
    if array.size == 0 or array.ndim != 2 and not (array.ndim == 3 and array.shape[2] in _CHANNEL_COUNTS):
        raise DatasetError(
            f"{path} holds an array of shape {tuple(shape)}; save images as HxW or HxWxC arrays with C in 1, 3 or 4"
        )
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    return array
