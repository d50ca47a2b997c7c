"""Finding the distinct values of a dataset's masks, and checking each mask fits its image.

The problems found are ``Finding``s: the dataset raises them as one error, the dataset check prints one line each.

The first scan decodes every mask, in a process pool. Its result is cached in a JSON file named by a hash of the
files' absolute paths, sizes, modification and change times and inodes (``FileInfo``), outside the user's data
folders, so later starts over unchanged files decode nothing. Like the rest of the data scan, this module must not
import torch (see ``utils.datasets.image_files``).
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from utils.datasets.image_files import (
    UNREADABLE_FILE_ERRORS,
    Finding,
    MaskPair,
    format_examples,
    image_header,
    load_image,
    pool_map,
)
from utils.errors import DatasetError, UserError, first_line
from utils.output_files import write_text

logger = logging.getLogger(__name__)

# Part of every cache key: bump it whenever decoding or the stored fields change, so older cache files stop matching.
CACHE_FORMAT_VERSION = 5  # 5: EXIF orientation applied; inode and ctime in the key
# The class index of a void pixel (a mask value passed as --ignore-value): cross-entropy's default ignore_index, and
# negative, so it can never be a class.
IGNORE_INDEX = -100

MaskValues = list[int] | list[list[int]]
JPEG_EXTENSIONS = (".jpg", ".jpeg")

# A file that raises one of these cannot be used; DatasetError comes from our own checks of arrays and modes.
UNUSABLE_FILE_ERRORS = (*UNREADABLE_FILE_ERRORS, DatasetError)


@dataclass(frozen=True)
class MaskScan:
    """What the dataset needs from its files: the masks' sorted distinct values, each image's ``(width, height)``
    and channel count as a photo (1 grey, 3 colour)."""

    mask_values: MaskValues
    image_sizes: dict[str, tuple[int, int]]
    image_channels: dict[str, int]
    value_counts: dict[str, tuple[tuple[int, int], ...]] = dataclasses.field(default_factory=dict)
    """Per image, ``(k, pixels)`` for each value ``mask_values[k]`` it contains (full-size masks, before scaling)."""
    problems: tuple[Finding, ...] = ()
    """Unreadable files, size mismatches, mixed mask kinds; the values and sizes above are then those of the usable
    pairs (and nothing is cached)."""

    def classes(self, ignore_values: Sequence[int]) -> tuple[MaskValues, dict[str, dict[int, int]], int]:
        """The class values (``mask_values`` less the void ``ignore_values``; class k is the k-th), per image the
        pixels of each class it holds, and the void pixels of all the masks."""
        kept = [k for k, value in enumerate(self.mask_values) if value not in ignore_values]
        class_of = {k: position for position, k in enumerate(kept)}
        per_image = {
            name: {class_of[k]: pixels for k, pixels in counts if k in class_of}
            for name, counts in self.value_counts.items()
        }
        void = sum(pixels for counts in self.value_counts.values() for k, pixels in counts if k not in class_of)
        return [self.mask_values[k] for k in kept], per_image, void


def class_totals(per_image: Iterable[dict[int, int]], n_classes: int) -> list[int]:
    """Pixels of each class over the images' ``MaskScan.classes`` counts."""
    totals = [0] * n_classes
    for counts in per_image:
        for k, pixels in counts.items():
            totals[k] += pixels
    return totals


def class_value_findings(
    values: MaskValues, pairs: Sequence[MaskPair], mask_dir: Path, n_classes: int | None, ignore_values: Sequence[int]
) -> tuple[list[Finding], list[Finding]]:
    """The rules on a dataset's class values (``MaskScan.classes``) as ``(problems, warnings)``, which the dataset
    raises and logs and the dataset check prints: more values than ``n_classes`` allows (1 means binary: two), void
    values on colour masks; one value, fewer values than classes, JPEG masks (whose noise makes extra values)."""
    problems, warnings = [], []
    jpeg = sorted(pair.mask.name for pair in pairs if pair.mask.ext in JPEG_EXTENSIONS)
    if jpeg:
        fix = "JPEG compression noise creates extra mask values along edges: save masks as PNG or GIF"
        warnings.append(Finding("JPEG masks", f"{len(jpeg)} mask(s) in {mask_dir} are JPEG files", tuple(jpeg), fix))
    if ignore_values and values and not isinstance(values[0], int):
        what = f"--ignore-value {ignore_values[0]} needs single-channel masks, but the masks in {mask_dir} are colour"
        problems.append(Finding("mask values", what, (), "save void pixels as a grey value or drop --ignore-value"))
    if len(values) == 1:
        what = f"every mask in {mask_dir} has the single value {values[0]}"
        warnings.append(Finding("mask values", what, (), "there is nothing to learn: check --masks"))
    if n_classes is None:
        return problems, warnings
    found = f"the masks in {mask_dir} contain {len(values)} distinct values ({format_examples(values, 10)})"
    allowed = 2 if n_classes == 1 else n_classes
    if len(values) > allowed:
        fix = (
            f"if each value is a class, the model needs --classes {len(values)}, or pass void values as --ignore-value"
        )
        if jpeg:
            fix += ", or re-save the JPEG masks as PNG/GIF (JPEG compression noise creates the extra values)"
        problems.append(Finding("mask values", f"{found} but n_classes={n_classes} allows at most {allowed}", (), fix))
    elif n_classes >= 2 and len(values) < n_classes:
        fix = f"mask_values[k] becomes class k, so classes {len(values)}..{n_classes - 1} never occur in these masks"
        warnings.append(Finding("mask values", f"{found} but n_classes={n_classes}", (), fix))
    return problems, warnings


@dataclass(frozen=True)
class _PairResult:
    """Outcome of scanning one pair in a worker; ``error`` is set instead of raising so every bad file is reported."""

    name: str
    image_size: tuple[int, int] = (0, 0)
    image_channels: int = 3
    mask_size: tuple[int, int] = (0, 0)
    colour: bool = False
    values: tuple = ()
    counts: tuple[int, ...] = ()
    """Pixels of each of ``values``."""
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


def value_counts(mask: np.ndarray) -> tuple[MaskValues, list[int]]:
    """The sorted distinct values of a ``mask_array`` (ints, or ``[r, g, b]`` lists for colour masks) and the number
    of pixels holding each."""
    if mask.ndim == 3:
        packed, counts = np.unique(_pack_rgb(mask), return_counts=True)
        return [[int(v) >> 16, (int(v) >> 8) & 0xFF, int(v) & 0xFF] for v in packed], counts.tolist()
    if mask.dtype in (np.uint8, np.uint16):
        # A histogram is several times faster than np.unique's sort for 8/16-bit masks.
        histogram = np.bincount(mask.ravel(), minlength=1)
        present = np.flatnonzero(histogram)
        return present.tolist(), histogram[present].tolist()
    values, counts = np.unique(mask, return_counts=True)
    return values.tolist(), counts.tolist()


def values_to_classes(
    mask: np.ndarray,
    mask_values: MaskValues,
    source: str | Path | None = None,
    ignore_values: Sequence[int] = (),
) -> np.ndarray:
    """Map a ``mask_array`` to int64 class indices: pixels equal to ``mask_values[k]`` become ``k``, pixels equal to
    one of ``ignore_values`` (void labels, single-channel masks only) become ``IGNORE_INDEX``.

    A value not in ``mask_values`` is a DatasetError naming ``source`` (the mask file), never class 0 as in
    milesial/Pytorch-UNet: it means the file changed after the scan, and training on it would teach wrong labels.
    """
    if not mask_values:
        raise DatasetError("mask_values is empty; it must list the mask value of every class")
    if mask.ndim == 3:
        if not all(isinstance(v, (list, tuple)) and len(v) == 3 for v in mask_values):
            raise DatasetError(f"a colour mask needs [r, g, b] mask values, got [{format_examples(mask_values, 10)}]")
        keys = _pack_rgb(np.asarray(mask_values, dtype=np.uint8)[None])[0].astype(np.int64)
        pixels = _pack_rgb(mask)
    else:
        if not all(isinstance(v, int | np.integer) for v in mask_values):
            raise DatasetError(
                f"a single-channel mask needs integer mask values, got [{format_examples(mask_values, 10)}]"
            )
        keys = np.asarray(mask_values, dtype=np.int64)
        pixels = mask
    # Void values join the keys with the class IGNORE_INDEX; a value both listed and ignored is a class.
    ignored = [v for v in ignore_values if v not in mask_values] if mask.ndim != 3 else []
    labels = np.concatenate([np.arange(len(keys), dtype=np.int64), np.full(len(ignored), IGNORE_INDEX, np.int64)])
    keys = np.concatenate([keys, np.asarray(ignored, dtype=np.int64)])
    if pixels.dtype == np.uint8:
        # A 256-entry lookup table maps every pixel in one pass; iterate in reverse so the first k wins a tie.
        table = np.full(256, len(keys), dtype=np.int64)
        for k in range(len(keys) - 1, -1, -1):
            if 0 <= keys[k] <= 255:
                table[keys[k]] = k
        position = table[pixels]
        known = position < len(keys)
        classes = np.append(labels, 0)[position]
    else:
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        position = np.minimum(np.searchsorted(sorted_keys, pixels), len(keys) - 1)
        known = sorted_keys[position] == pixels
        classes = np.where(known, labels[order[position]], 0).astype(np.int64)
    if not known.all():
        flat = mask.reshape(-1, 3) if mask.ndim == 3 else mask.reshape(-1)
        unknown = np.unique(flat[~known.reshape(-1)], axis=0)
        raise DatasetError(
            f"{source or 'a mask'} holds mask value(s) [{format_examples(unknown.tolist(), 10)}] that are not among "
            f"the dataset's mask values [{format_examples(mask_values, 10)}]: the file changed after the masks were "
            "scanned; fix it (or restore it) and start again"
        )
    return classes


def scan_masks(
    pairs: Sequence[MaskPair],
    *,
    cache_dir: str | Path | None = None,
    workers: int | None = None,
) -> MaskScan:
    """Return the masks' distinct values and the images' sizes, from the cache when the files have not changed.

    Every unreadable file, every mask whose size differs from its image, and masks that mix single-channel and
    colour files come back in ``problems`` (the dataset raises them, the check prints each kind on its own line).
    ``workers``: processes (``image_files.pool_map``).
    """
    if not pairs:
        raise ValueError("scan_masks needs at least one image/mask pair")
    cache_file = Path(cache_dir if cache_dir is not None else default_cache_dir()) / f"{_cache_key(pairs)}.json"
    cached = _read_cache(cache_file, pairs)
    if cached is not None:
        logger.info("Mask values of %d masks read from cache %s", len(pairs), cache_file)
        return cached
    started = time.perf_counter()
    announce = "Scanning %d masks with %d processes (cached for the next start)"
    scan = _summarise(pool_map(_scan_pair, pairs, workers, announce), pairs)
    if scan.problems:
        return scan
    logger.info(
        "Scanned %d masks in %.1f s; %d distinct values",
        len(pairs),
        time.perf_counter() - started,
        len(scan.mask_values),
    )
    _write_cache(cache_file, scan, pairs)
    return scan


def _scan_pair(pair: MaskPair) -> _PairResult:
    """Decode one mask, read its image's size from the header, and report any failure as text."""
    try:
        width, height, channels = image_header(pair.image.path)
    except UNUSABLE_FILE_ERRORS as err:
        return _PairResult(pair.name, error=f"{pair.image.path} ({first_line(err)})")
    try:
        with load_image(pair.mask.path) as img:
            if img.mode in ("L", "P"):
                # PIL's C histogram costs next to nothing beyond decoding; going through numpy doubles the time.
                histogram = img.histogram()
                values = [i for i, count in enumerate(histogram) if count]
                counts, mask_wh, colour = [histogram[i] for i in values], img.size, False
            else:
                mask = mask_array(img, pair.mask.path)
                (values, counts), mask_wh, colour = value_counts(mask), (mask.shape[1], mask.shape[0]), mask.ndim == 3
    except UNUSABLE_FILE_ERRORS as err:
        return _PairResult(pair.name, error=f"{pair.mask.path} ({first_line(err)})")
    return _PairResult(
        name=pair.name,
        image_size=(width, height),
        image_channels=channels,
        mask_size=mask_wh,
        colour=colour,
        values=tuple(tuple(v) for v in values) if colour else tuple(values),
        counts=tuple(counts),
    )


def _summarise(results: list[_PairResult], pairs: Sequence[MaskPair]) -> MaskScan:
    """Merge per-pair results: the values and sizes of the usable pairs, and every problem found."""
    by_name = {pair.name: pair for pair in pairs}
    unreadable = [r.error for r in results if r.error is not None]
    readable = [r for r in results if r.error is None]
    mismatched = [
        f"mask {by_name[r.name].mask.name} is {_wh(r.mask_size)} but image {by_name[r.name].image.name} "
        f"is {_wh(r.image_size)}"
        for r in readable
        if r.mask_size != r.image_size
    ]
    usable = [r for r in readable if r.mask_size == r.image_size]
    colour = [by_name[r.name].mask.name for r in readable if r.colour]
    single = [by_name[r.name].mask.name for r in readable if not r.colour]

    problems = []
    if unreadable:
        what = f"{len(unreadable)} file(s) cannot be read as images"
        problems.append(Finding("unreadable files", what, tuple(unreadable), "replace or delete them"))
    if mismatched:
        what = f"{len(mismatched)} mask(s) differ in size from their image"
        fix = "each mask must have exactly its image's width and height"
        problems.append(Finding("size mismatches", what, tuple(mismatched), fix))
    if colour and single:
        what = (
            f"the masks mix colour files ({len(colour)}, e.g. {format_examples(colour)}) and single-channel files "
            f"({len(single)}, e.g. {format_examples(single)})"
        )
        problems.append(Finding("masks", what, (), "save all masks one way (all RGB or all grey/palette)"))
        usable = []  # their values cannot be merged

    distinct = sorted(set().union(*(r.values for r in usable)))
    values: MaskValues = [list(v) for v in distinct] if colour else distinct
    index_of = {value: k for k, value in enumerate(distinct)}
    return MaskScan(
        mask_values=values,
        image_sizes={r.name: r.image_size for r in usable},
        image_channels={r.name: r.image_channels for r in usable},
        value_counts={r.name: tuple((index_of[v], c) for v, c in zip(r.values, r.counts, strict=True)) for r in usable},
        problems=tuple(problems),
    )


def _wh(size: tuple[int, int]) -> str:
    return f"{size[0]}x{size[1]}"


def _pack_rgb(mask: np.ndarray) -> np.ndarray:
    """Pack HxWx3 uint8 colours into one int32 per pixel, preserving their lexicographic order."""
    rgb = mask.astype(np.int32)
    return (rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]


def _cache_key(pairs: Sequence[MaskPair]) -> str:
    # FileInfo paths are already absolute. Strings joined with NUL (which no path contains) and the stat numbers as
    # one int64 array: no per-pair formatting, so a 100,000-pair key costs tens of milliseconds.
    digest = hashlib.sha256(f"{CACHE_FORMAT_VERSION}\0".encode())
    for field in ("name", "image", "mask"):
        strings = [p.name for p in pairs] if field == "name" else [getattr(p, field).path for p in pairs]
        digest.update("\0".join(strings).encode("utf-8", "surrogateescape") + b"\1")
    numbers = array.array(
        "q",
        [n for p in pairs for info in (p.image, p.mask) for n in (info.size, info.mtime_ns, info.inode, info.ctime_ns)],
    )
    digest.update(numbers.tobytes())
    return digest.hexdigest()


def _read_cache(cache_file: Path, pairs: Sequence[MaskPair]) -> MaskScan | None:
    """Return the cached scan, or ``None`` if there is none or it is unusable (then the caller rescans)."""
    try:
        content = json.loads(cache_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        logger.warning("Ignoring unreadable mask-value cache %s (%s); scanning the masks again", cache_file, err)
        return None
    scan = _parse_cache(content, [pair.name for pair in pairs])
    if scan is None:
        logger.warning("Ignoring malformed mask-value cache %s; scanning the masks again", cache_file)
    return scan


def _parse_cache(content: object, names: list[str]) -> MaskScan | None:
    """The scan stored by ``_write_cache``: per-image lists in the pairs' order (the key fixes names and order);
    ``value_counts`` holds ``[k0, count0, k1, count1, ...]`` per image. None when anything is malformed."""
    if not isinstance(content, dict) or content.get("format") != CACHE_FORMAT_VERSION:
        return None
    values = content.get("mask_values")
    columns = [content.get(key) for key in ("widths", "heights", "channels", "value_counts")]
    if not isinstance(values, list) or not values:
        return None
    if not all(isinstance(column, list) and len(column) == len(names) for column in columns):
        return None
    widths, heights, channels, flat_counts = columns
    # Whole-list checks (C loops): this runs over every image at every start. type() is int: no bools, no floats.
    if not set(map(type, flat_counts)) <= {list} or any(len(flat) % 2 for flat in flat_counts):
        return None
    if not all(set(map(type, column)) <= {int} for column in (widths, heights, channels, *flat_counts)):
        return None
    if names and (min(widths) <= 0 or min(heights) <= 0 or not set(channels) <= {1, 3}):
        return None
    colours = all(type(v) is list and len(v) == 3 and all(type(c) is int and 0 <= c <= 255 for c in v) for v in values)
    if not (colours or all(type(v) is int for v in values)):
        return None
    counts = [tuple(zip(flat[::2], flat[1::2], strict=True)) for flat in flat_counts]
    if any(not 0 <= k < len(values) or count <= 0 for pairs in counts for k, count in pairs):
        return None
    return MaskScan(
        mask_values=values,
        image_sizes=dict(zip(names, zip(widths, heights, strict=True), strict=True)),
        image_channels=dict(zip(names, channels, strict=True)),
        value_counts=dict(zip(names, counts, strict=True)),
    )


def _write_cache(cache_file: Path, scan: MaskScan, pairs: Sequence[MaskPair]) -> None:
    """Write the cache all or nothing (``output_files.write_text``): readers see the old file or the whole new one."""
    content = {
        "format": CACHE_FORMAT_VERSION,
        "mask_values": scan.mask_values,
        "widths": [scan.image_sizes[pair.name][0] for pair in pairs],
        "heights": [scan.image_sizes[pair.name][1] for pair in pairs],
        "channels": [scan.image_channels[pair.name] for pair in pairs],
        "value_counts": [[n for pair_count in scan.value_counts[pair.name] for n in pair_count] for pair in pairs],
    }
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        write_text(cache_file, json.dumps(content, separators=(",", ":")))
    except (OSError, UserError) as err:
        # The cache only saves time; a read-only home must not stop training.
        logger.warning(
            "Could not write mask-value cache %s (%s); the next start will scan the masks again", cache_file, err
        )
