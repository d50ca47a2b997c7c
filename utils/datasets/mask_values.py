"""Finding the distinct values of a dataset's masks, and checking each mask fits its image.

The problems found are ``Finding``s: the dataset raises them as one error, the dataset check prints one line each.

The first scan decodes every mask, in a process pool. What it read of each pair is cached in a JSON file named by a
hash of the files' absolute paths, sizes, modification and change times and inodes (``image_files.cache_key``),
outside the user's data folders, so later starts over unchanged files decode nothing; the file holds the sha256 of its
rows, so a cache changed or damaged after it was written is scanned again, never used. Like the rest of the data
scan, this module must not import torch (see ``utils.datasets.image_files``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
from PIL import Image

from utils.datasets.image_files import (
    UNREADABLE_FILE_ERRORS,
    Finding,
    MaskPair,
    cache_key,
    format_examples,
    image_header,
    load_image,
    pool_map,
)
from utils.errors import DatasetError, UserError, first_line
from utils.output_files import write_text

logger = logging.getLogger(__name__)

# Part of every cache key: bump it whenever decoding or the stored fields change, so older cache files stop matching.
CACHE_FORMAT_VERSION = 6  # 5: EXIF orientation applied; inode and ctime in the key. 6: rows per pair, sha256
# The class index of a void pixel (a mask value passed as --ignore-value): cross-entropy's default ignore_index, and
# negative, so it can never be a class.
IGNORE_INDEX = -100
# What values_to_classes gives a pixel whose value is no mask value: neither a class nor IGNORE_INDEX.
_UNKNOWN = -1
# A cache file is {"sha256":"<hex>","rows":<JSON rows>}: the rows' text follows this.
_ROWS_KEY = ',"rows":'

MaskValues = list[int] | list[list[int]]
JPEG_EXTENSIONS = (".jpg", ".jpeg")

# A file that raises one of these cannot be used; DatasetError comes from our own checks of arrays and modes.
UNUSABLE_FILE_ERRORS = (*UNREADABLE_FILE_ERRORS, DatasetError)


class PairScan(NamedTuple):
    """What a worker read of one pair (the cache file holds the usable ones, less their names); a problem is set
    instead of raising, so every bad file is reported."""

    name: str
    image_size: tuple[int, int] = (0, 0)
    """The image's ``(width, height)``, as loaded (EXIF orientation applied)."""
    image_channels: int = 3
    """As a photo: 1 grey, 3 colour."""
    colour: bool = False
    values: tuple[int, ...] = ()
    """The mask's distinct values (colours packed as ``0xRRGGBB``)."""
    counts: tuple[int, ...] = ()
    """Pixels of each of ``values`` (full-size masks, before scaling)."""
    unreadable: str | None = None
    """The file that cannot be read, and why."""
    mismatch: str | None = None
    """The mask's size and its image's, when they differ."""


class MaskScan(NamedTuple):
    """What the dataset needs from its files: the masks' sorted distinct values and what was read of each pair."""

    mask_values: MaskValues
    pairs: dict[str, PairScan]
    """The usable pairs, by image id."""
    problems: tuple[Finding, ...] = ()
    """Unreadable files, size mismatches, mixed mask kinds; the values and pairs above are then those of the usable
    pairs (and nothing is cached)."""

    def classes(self, ignore_values: Sequence[int]) -> tuple[MaskValues, dict[str, dict[int, int]], int]:
        """The class values (``mask_values`` less the void ``ignore_values``; class k is the k-th), per image the
        pixels of each class it holds, and the void pixels of all the masks."""
        kept = [value for value in self.mask_values if value not in ignore_values]
        class_of = {_packed(value): k for k, value in enumerate(kept)}
        per_image = {
            name: {class_of[v]: pixels for v, pixels in zip(r.values, r.counts, strict=True) if v in class_of}
            for name, r in self.pairs.items()
        }
        void = sum(sum(r.counts) for r in self.pairs.values()) - sum(sum(c.values()) for c in per_image.values())
        return kept, per_image, void


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
    if mode == "F":
        raise DatasetError(f"mask {path} holds floating-point values; save masks as integer class indices (PNG/GIF)")
    return np.asarray(img.convert("L" if mode == "LA" else "RGB"))


def value_counts(mask: np.ndarray) -> tuple[list[int], list[int]]:
    """The sorted distinct values of a ``mask_array`` (colours packed by ``_pack_rgb``) and the number of pixels
    holding each."""
    pixels = _pack_rgb(mask) if mask.ndim == 3 else mask
    if pixels.dtype in (np.uint8, np.uint16):
        # A histogram is several times faster than np.unique's sort for 8/16-bit masks.
        histogram = np.bincount(pixels.ravel(), minlength=1)
        present = np.flatnonzero(histogram)
        return present.tolist(), histogram[present].tolist()
    values, counts = np.unique(pixels, return_counts=True)
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
    colour = mask.ndim == 3
    if colour and not all(isinstance(v, list | tuple) and len(v) == 3 for v in mask_values):
        raise DatasetError(f"a colour mask needs [r, g, b] mask values, got [{format_examples(mask_values, 10)}]")
    if not colour and not all(isinstance(v, int | np.integer) for v in mask_values):
        raise DatasetError(f"a single-channel mask needs integer mask values, got [{format_examples(mask_values, 10)}]")
    # Void values become IGNORE_INDEX unless listed as a class; a value listed twice keeps its first class.
    label_of = dict.fromkeys([] if colour else ignore_values, IGNORE_INDEX)
    label_of.update((_packed(value), k) for k, value in reversed(list(enumerate(mask_values))))
    keys = np.array(sorted(label_of), dtype=np.int64)
    labels = np.array([label_of[key] for key in keys.tolist()], dtype=np.int64)

    def classes_of(values: np.ndarray) -> np.ndarray:
        position = np.minimum(np.searchsorted(keys, values), len(keys) - 1)
        return np.where(keys[position] == values, labels[position], _UNKNOWN)

    pixels = _pack_rgb(mask) if colour else mask
    # 8-bit masks through a table of all 256 values made by the same rule: one gather per pixel, twice as fast.
    classes = classes_of(np.arange(256))[pixels] if pixels.dtype == np.uint8 else classes_of(pixels)
    unknown = classes == _UNKNOWN
    if unknown.any():
        values = [_unpack_rgb(v) if colour else v for v in np.unique(pixels[unknown]).tolist()]
        raise DatasetError(
            f"{source or 'a mask'} holds mask value(s) [{format_examples(values, 10)}] that are not among "
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
    assert pairs, "scan_masks needs at least one image/mask pair"  # its callers stop at a folder without any
    records = [info for pair in pairs for info in (pair.image, pair.mask)]
    cache_file = Path(cache_dir or default_cache_dir()) / f"{cache_key(records, CACHE_FORMAT_VERSION)}.json"
    rows = _read_cache(cache_file, pairs)
    if rows is not None:
        logger.info("Mask values of %d masks read from cache %s", len(pairs), cache_file)
        return _summarise(rows, pairs)
    started = time.perf_counter()
    rows = pool_map(_scan_pair, pairs, workers, "Scanning %d masks with %d processes (cached for the next start)")
    scan = _summarise(rows, pairs)
    if not scan.problems:
        seconds = time.perf_counter() - started
        logger.info("Scanned %d masks in %.1f s; %d distinct values", len(pairs), seconds, len(scan.mask_values))
        _write_cache(cache_file, rows)
    return scan


def _scan_pair(pair: MaskPair) -> PairScan:
    """Decode one mask, read its image's size from the header, and report any failure as text."""
    try:
        width, height, channels = image_header(pair.image.path)
    except UNUSABLE_FILE_ERRORS as err:
        return PairScan(pair.name, unreadable=f"{pair.image.path} ({first_line(err)})")
    try:
        with load_image(pair.mask.path) as img:
            if img.size != (width, height):
                mismatch = f"mask {pair.mask.name} is {img.width}x{img.height} but image {pair.image.name} is"
                return PairScan(pair.name, mismatch=f"{mismatch} {width}x{height}")
            if img.mode in ("L", "P"):
                # PIL's C histogram costs next to nothing beyond decoding; going through numpy doubles the time.
                histogram = img.histogram()
                values, colour = [i for i, count in enumerate(histogram) if count], False
                counts = [histogram[i] for i in values]
            else:
                mask = mask_array(img, pair.mask.path)
                (values, counts), colour = value_counts(mask), mask.ndim == 3
            return PairScan(pair.name, (width, height), channels, colour, tuple(values), tuple(counts))
    except UNUSABLE_FILE_ERRORS as err:
        return PairScan(pair.name, unreadable=f"{pair.mask.path} ({first_line(err)})")


def _summarise(rows: Sequence[PairScan], pairs: Sequence[MaskPair]) -> MaskScan:
    """Merge per-pair rows (scanned, or read from the cache): the values of the usable pairs, and every problem
    found."""
    unreadable = [r.unreadable for r in rows if r.unreadable is not None]
    mismatched = [r.mismatch for r in rows if r.mismatch is not None]
    usable = [r for r in rows if r.unreadable is None and r.mismatch is None]
    colour = [r for r in usable if r.colour]
    problems = []
    if unreadable:
        what = f"{len(unreadable)} file(s) cannot be read as images"
        problems.append(Finding("unreadable files", what, tuple(unreadable), "replace or delete them"))
    if mismatched:
        what = f"{len(mismatched)} mask(s) differ in size from their image"
        fix = "each mask must have exactly its image's width and height"
        problems.append(Finding("size mismatches", what, tuple(mismatched), fix))
    if colour and len(colour) < len(usable):
        mask_names = {pair.name: pair.mask.name for pair in pairs}
        colour_names = [mask_names[r.name] for r in colour]
        single = [mask_names[r.name] for r in usable if not r.colour]
        what = (
            f"the masks mix colour files ({len(colour)}, e.g. {format_examples(colour_names)}) and single-channel "
            f"files ({len(single)}, e.g. {format_examples(single)})"
        )
        problems.append(Finding("masks", what, (), "save all masks one way (all RGB or all grey/palette)"))
        usable = []  # their values cannot be merged
    distinct = sorted(set().union(*(r.values for r in usable)))
    values = [_unpack_rgb(v) for v in distinct] if colour else distinct
    return MaskScan(values, {r.name: r for r in usable}, tuple(problems))


def _pack_rgb(mask: np.ndarray) -> np.ndarray:
    """Pack HxWx3 uint8 colours into one int32 per pixel (0xRRGGBB), preserving their lexicographic order."""
    rgb = mask.astype(np.int32)
    return (rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]


def _unpack_rgb(packed: int) -> list[int]:
    return [packed >> 16, (packed >> 8) & 0xFF, packed & 0xFF]


def _packed(value: int | list[int]) -> int:
    """A mask value as ``PairScan.values`` holds it: colours packed as ``_pack_rgb`` packs them."""
    return (value[0] << 16) | (value[1] << 8) | value[2] if isinstance(value, list | tuple) else int(value)


def _read_cache(cache_file: Path, pairs: Sequence[MaskPair]) -> list[PairScan] | None:
    """The rows ``_write_cache`` stored, or None (the caller scans again) if there are none or they are unusable."""
    try:
        text = cache_file.read_text(encoding="utf-8")
        content = json.loads(text)
        # The sha256 of the rows' text as written, after the key that _write_cache puts last: no second encoding.
        if _digest(text[text.find(_ROWS_KEY) + len(_ROWS_KEY) : -1]) != content["sha256"]:
            raise ValueError("its rows do not match their sha256: the file changed after it was written")
        # The key fixed the pairs and their order: each row is a pair's, less its name (and its problems: none).
        return [PairScan(pair.name, *row) for pair, row in zip(pairs, content["rows"], strict=True)]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as err:  # TypeError, KeyError: not the layout written here
        logger.warning("Ignoring unreadable mask-value cache %s (%s); scanning the masks again", cache_file, err)
        return None


def _write_cache(cache_file: Path, scans: list[PairScan]) -> None:
    """Write the cache all or nothing (``output_files.write_text``): readers see the old file or the whole new one."""
    rows = json.dumps([scan[1:-2] for scan in scans], separators=(",", ":"))  # less the name and the two problems
    try:
        write_text(cache_file, f'{{"sha256":"{_digest(rows)}"{_ROWS_KEY}{rows}}}')
    except (OSError, UserError) as err:
        # The cache only saves time; a read-only home must not stop training.
        logger.warning(
            "Could not write mask-value cache %s (%s); the next start will scan the masks again", cache_file, err
        )


def _digest(rows: str) -> str:
    """The sha256 of the rows' JSON text: a cache file whose rows were changed or damaged after it was written is
    scanned again, never used (its layout and values need no check of their own)."""
    return hashlib.sha256(rows.encode()).hexdigest()
