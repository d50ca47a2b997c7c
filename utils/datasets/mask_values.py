"""Finding the distinct values of a dataset's masks, and checking each mask fits its image.

The first scan decodes every mask, in a process pool. Its result is cached in a JSON file named by a hash of the
files' absolute paths, sizes and modification times, outside the user's data folders, so later starts over unchanged
files decode nothing. Like the rest of the data scan, this module must not import
torch (see ``utils.datasets.image_files``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from utils.datasets.image_files import UNREADABLE_FILE_ERRORS, FileInfo, image_size, load_image
from utils.errors import ConfigError, DatasetError

logger = logging.getLogger(__name__)

# Part of every cache key: bump it whenever decoding or the stored fields change, so older cache files stop matching.
CACHE_FORMAT_VERSION = 2
# Below this many masks a pool costs more to start than it saves.
MIN_MASKS_FOR_POOL = 32
MAX_DEFAULT_WORKERS = 8
# How many problem files an error message names before it just counts them.
MAX_NAMED_FILES = 5

MaskValues = list[int] | list[list[int]]

# A file that raises one of these cannot be used; DatasetError comes from our own checks of arrays and modes.
_UNREADABLE_ERRORS = (*UNREADABLE_FILE_ERRORS, DatasetError)


@dataclass(frozen=True)
class MaskPair:
    """An image and its mask; ``name`` is the image id."""

    name: str
    image: FileInfo
    mask: FileInfo


@dataclass(frozen=True)
class MaskScan:
    """What the dataset needs from its masks: the sorted distinct values and each image's ``(width, height)``."""

    mask_values: MaskValues
    image_sizes: dict[str, tuple[int, int]]


@dataclass(frozen=True)
class _PairResult:
    """Outcome of scanning one pair in a worker; ``error`` is set instead of raising so every bad file is reported."""

    name: str
    image_size: tuple[int, int] = (0, 0)
    mask_size: tuple[int, int] = (0, 0)
    colour: bool = False
    values: tuple = ()
    error: str | None = None


def default_cache_dir() -> Path:
    """Return ``$XDG_CACHE_HOME/unet-ddp/mask-values``, or ``~/.cache/unet-ddp/mask-values`` without XDG."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "unet-ddp" / "mask-values"


def mask_array(img: Image.Image, path: str | Path = "<mask>") -> np.ndarray:
    """Return a mask's values as HxW integers or HxWx3 uint8 colours.

    Palette images give their palette indices (as Carvana's GIFs: 0/1), bilevel images 0/1 (as milesial reads them,
    and as predict.py writes Carvana masks), alpha is dropped, and
    16/32-bit grey images keep their integer values. Float masks are refused: their values are not class labels.
    """
    mode = img.mode
    if mode in ("L", "P", "RGB", "I") or mode.startswith("I;16"):
        return np.asarray(img)
    if mode == "PA":
        return np.asarray(img)[:, :, 0]
    if mode == "1":
        return np.asarray(img).astype(np.uint8)
    if mode == "LA":
        return np.asarray(img.convert("L"))
    if mode == "F":
        raise DatasetError(f"mask {path} holds floating-point values; save masks as integer class indices (PNG/GIF)")
    return np.asarray(img.convert("RGB"))


def distinct_values(mask: np.ndarray) -> MaskValues:
    """Return the sorted distinct values of a ``mask_array``: ints, or ``[r, g, b]`` lists for colour masks."""
    if mask.ndim == 3:
        packed = _pack_rgb(mask)
        return [[int(v) >> 16, (int(v) >> 8) & 0xFF, int(v) & 0xFF] for v in np.unique(packed)]
    if mask.dtype in (np.uint8, np.uint16):
        # A histogram is several times faster than np.unique's sort for 8/16-bit masks.
        return np.flatnonzero(np.bincount(mask.ravel(), minlength=1)).tolist()
    return np.unique(mask).tolist()


def values_to_classes(mask: np.ndarray, mask_values: MaskValues) -> np.ndarray:
    """Map a ``mask_array`` to int64 class indices: pixels equal to ``mask_values[k]`` become ``k``.

    Values not in ``mask_values`` become 0, as in milesial/Pytorch-UNet (a dataset's own masks never have any).
    """
    if not mask_values:
        raise DatasetError("mask_values is empty; it must list the mask value of every class")
    if mask.ndim == 3:
        if not all(isinstance(v, (list, tuple)) and len(v) == 3 for v in mask_values):
            raise DatasetError(f"a colour mask needs [r, g, b] mask values, got {_preview(mask_values)}")
        keys = _pack_rgb(np.asarray(mask_values, dtype=np.uint8)[None])[0].astype(np.int64)
        pixels = _pack_rgb(mask)
    else:
        if not all(isinstance(v, int | np.integer) for v in mask_values):
            raise DatasetError(f"a single-channel mask needs integer mask values, got {_preview(mask_values)}")
        keys = np.asarray(mask_values, dtype=np.int64)
        pixels = mask
    if pixels.dtype == np.uint8:
        # A 256-entry lookup table maps every pixel in one pass; iterate in reverse so the first k wins a tie.
        table = np.zeros(256, dtype=np.int64)
        for k in range(len(keys) - 1, -1, -1):
            if 0 <= keys[k] <= 255:
                table[keys[k]] = k
        return table[pixels]
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    position = np.minimum(np.searchsorted(sorted_keys, pixels), len(keys) - 1)
    return np.where(sorted_keys[position] == pixels, order[position], 0).astype(np.int64)


def _preview(values: Sequence, limit: int = 10) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return f"[{shown}, ... ({len(values)} in all)]" if len(values) > limit else f"[{shown}]"


def scan_masks(
    pairs: Sequence[MaskPair], *, cache_dir: str | Path | None = None, workers: int | None = None
) -> MaskScan:
    """Return the masks' distinct values and the images' sizes, from the cache when the files have not changed.

    Raises one ``DatasetError`` naming every unreadable file, every mask whose size differs from its image, and
    masks that mix single-channel and colour files.
    """
    if not pairs:
        raise ValueError("scan_masks needs at least one image/mask pair")
    cache_file = Path(cache_dir if cache_dir is not None else default_cache_dir()) / f"{_cache_key(pairs)}.json"
    cached = _read_cache(cache_file, pairs)
    if cached is not None:
        logger.info("Mask values of %d masks read from cache %s", len(pairs), cache_file)
        return cached
    started = time.perf_counter()
    scan = _summarise(_scan_all(pairs, _worker_count(workers)), pairs)
    logger.info(
        "Scanned %d masks in %.1f s; %d distinct values",
        len(pairs),
        time.perf_counter() - started,
        len(scan.mask_values),
    )
    _write_cache(cache_file, scan)
    return scan


def _worker_count(workers: int | None) -> int:
    if workers is None:
        # Imported here: the scan's worker processes import this module and must not pay for importing torch.
        from utils.hardware import available_cpus

        return min(available_cpus(), MAX_DEFAULT_WORKERS)
    if workers < 1:
        raise ConfigError(f"scan_workers must be at least 1, got {workers}")
    return workers


def _scan_all(pairs: Sequence[MaskPair], workers: int) -> list[_PairResult]:
    if workers == 1 or len(pairs) < MIN_MASKS_FOR_POOL:
        return [_scan_pair(pair) for pair in pairs]
    logger.info("Scanning %d masks with %d processes (cached for the next start)", len(pairs), workers)
    # Large chunks keep inter-process traffic low; several per worker keep the load balanced.
    chunksize = max(1, len(pairs) // (workers * 8))
    with ProcessPoolExecutor(max_workers=workers, mp_context=_pool_context()) as pool:
        return list(pool.map(_scan_pair, pairs, chunksize=chunksize))


def _pool_context() -> multiprocessing.context.BaseContext:
    # fork starts workers in milliseconds and the workers run only numpy/PIL code (it is what DataLoader uses on
    # Linux too). spawn/forkserver would re-import the caller's __main__ (e.g. train.py and torch) in every worker.
    if sys.platform == "linux":
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def _scan_pair(pair: MaskPair) -> _PairResult:
    """Decode one mask, read its image's size from the header, and report any failure as text."""
    try:
        image_wh = image_size(pair.image.path)
    except _UNREADABLE_ERRORS as err:
        return _PairResult(pair.name, error=f"{pair.image.path} ({_reason(err)})")
    try:
        with load_image(pair.mask.path) as img:
            if img.mode in ("L", "P"):
                # PIL's C histogram costs next to nothing beyond decoding; going through numpy doubles the time.
                values, mask_wh, colour = [i for i, count in enumerate(img.histogram()) if count], img.size, False
            else:
                mask = mask_array(img, pair.mask.path)
                values, mask_wh, colour = distinct_values(mask), (mask.shape[1], mask.shape[0]), mask.ndim == 3
    except _UNREADABLE_ERRORS as err:
        return _PairResult(pair.name, error=f"{pair.mask.path} ({_reason(err)})")
    return _PairResult(
        name=pair.name,
        image_size=image_wh,
        mask_size=mask_wh,
        colour=colour,
        values=tuple(tuple(v) for v in values) if colour else tuple(values),
    )


def _reason(err: BaseException) -> str:
    """The first line of an exception's message: some libraries write paragraphs."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _summarise(results: list[_PairResult], pairs: Sequence[MaskPair]) -> MaskScan:
    """Merge per-pair results, raising one ``DatasetError`` that lists every problem found."""
    by_name = {pair.name: pair for pair in pairs}
    unreadable = [r.error for r in results if r.error is not None]
    readable = [r for r in results if r.error is None]
    mismatched = [
        f"mask {by_name[r.name].mask.path.name} is {_wh(r.mask_size)} but image {by_name[r.name].image.path.name} "
        f"is {_wh(r.image_size)}"
        for r in readable
        if r.mask_size != r.image_size
    ]
    colour = [by_name[r.name].mask.path.name for r in readable if r.colour]
    single = [by_name[r.name].mask.path.name for r in readable if not r.colour]

    problems = []
    if unreadable:
        problems.append(
            f"{len(unreadable)} file(s) cannot be read as images: {format_examples(unreadable)}; replace or delete them"
        )
    if mismatched:
        problems.append(
            f"{len(mismatched)} mask(s) differ in size from their image: {format_examples(mismatched)}; "
            "each mask must have exactly its image's width and height"
        )
    if colour and single:
        problems.append(
            f"the masks mix colour files ({len(colour)}, e.g. {format_examples(colour)}) and single-channel files "
            f"({len(single)}, e.g. {format_examples(single)}); save all masks one way (all RGB or all grey/palette)"
        )
    if problems:
        mask_dir = pairs[0].mask.path.parent
        raise DatasetError(f"bad data in {mask_dir} / {pairs[0].image.path.parent}: " + "; ".join(problems))

    distinct = set().union(*(r.values for r in readable))
    values: MaskValues = [list(v) for v in sorted(distinct)] if colour else sorted(distinct)
    return MaskScan(mask_values=values, image_sizes={r.name: r.image_size for r in readable})


def format_examples(items: list[str]) -> str:
    """Join the first few names of a list for an error message, counting the rest."""
    shown = ", ".join(items[:MAX_NAMED_FILES])
    return shown if len(items) <= MAX_NAMED_FILES else f"{shown}, ... ({len(items) - MAX_NAMED_FILES} more)"


def _wh(size: tuple[int, int]) -> str:
    return f"{size[0]}x{size[1]}"


def _pack_rgb(mask: np.ndarray) -> np.ndarray:
    """Pack HxWx3 uint8 colours into one int32 per pixel, preserving their lexicographic order."""
    rgb = mask.astype(np.int32)
    return (rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]


def _cache_key(pairs: Sequence[MaskPair]) -> str:
    # abspath is string work only (no syscalls), so hashing thousands of entries stays cheap.
    entries = [
        [
            p.name,
            os.path.abspath(p.image.path),
            p.image.size,
            p.image.mtime_ns,
            os.path.abspath(p.mask.path),
            p.mask.size,
            p.mask.mtime_ns,
        ]
        for p in pairs
    ]
    payload = json.dumps([CACHE_FORMAT_VERSION, entries], separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


def _read_cache(cache_file: Path, pairs: Sequence[MaskPair]) -> MaskScan | None:
    """Return the cached scan, or ``None`` if there is none or it is unusable (then the caller rescans)."""
    try:
        content = json.loads(cache_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        logger.warning("Ignoring unreadable mask-value cache %s (%s); scanning the masks again", cache_file, err)
        return None
    scan = _parse_cache(content, {pair.name for pair in pairs})
    if scan is None:
        logger.warning("Ignoring malformed mask-value cache %s; scanning the masks again", cache_file)
    return scan


def _parse_cache(content: object, names: set[str]) -> MaskScan | None:
    if not isinstance(content, dict) or content.get("format") != CACHE_FORMAT_VERSION:
        return None
    values, sizes = content.get("mask_values"), content.get("image_sizes")
    if not isinstance(values, list) or not values or not isinstance(sizes, dict) or set(sizes) != names:
        return None
    if not (all(_is_int(v) for v in values) or all(_is_colour(v) for v in values)):
        return None
    if not all(isinstance(s, list) and len(s) == 2 and all(_is_int(x) and x > 0 for x in s) for s in sizes.values()):
        return None
    return MaskScan(mask_values=values, image_sizes={name: (s[0], s[1]) for name, s in sizes.items()})


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_colour(value: object) -> bool:
    return isinstance(value, list) and len(value) == 3 and all(_is_int(c) and 0 <= c <= 255 for c in value)


def _write_cache(cache_file: Path, scan: MaskScan) -> None:
    """Write the cache atomically (temp file, fsync, rename): readers see the old file or the whole new one."""
    content = {
        "format": CACHE_FORMAT_VERSION,
        "mask_values": scan.mask_values,
        "image_sizes": {name: list(size) for name, size in scan.image_sizes.items()},
    }
    tmp_name = None
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=cache_file.parent, prefix=f".{cache_file.stem[:16]}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(content, handle, separators=(",", ":"))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, cache_file)
        tmp_name = None
    except OSError as err:
        # The cache only saves time; a read-only home must not stop training.
        logger.warning(
            "Could not write mask-value cache %s (%s); the next start will scan the masks again", cache_file, err
        )
    finally:
        if tmp_name is not None and os.path.exists(tmp_name):
            os.unlink(tmp_name)
