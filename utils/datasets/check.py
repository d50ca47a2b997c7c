"""``python -m utils.datasets.check``: check a dataset before a long run, reading every file once, in parallel.

    python -m utils.datasets.check --imgs data/imgs --masks data/masks [--classes K] [--ignore-value V]
                                   [--split-by prefix] [--validation 10] [--folds N --fold K] [--strict]

Reports pairing problems (images without a mask, masks without an image, empty files), unreadable files, masks whose
size differs from their image, the mask values and each class's share of the pixels, photos with an EXIF rotation,
exact duplicate photos (same bytes) and, with ``--split-by``, duplicates that land on both sides of the
train/validation line. The mask values come from the same cached scan as training (``utils.datasets.mask_values``),
so a second check of unchanged folders (and the training start after it) decodes no mask again.

Exit status: 0 when training would start (warnings are printed and do not count unless ``--strict``), 1 with one
``problem:`` line per kind of problem (its count and the first few files), 2 for a bad flag or a missing folder.
Like the mask scan, this module does not import torch (its workers start fast).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from PIL import Image

from utils.datasets.image_files import (
    ARRAY_EXTENSIONS,
    UNREADABLE_FILE_ERRORS,
    exif_orientation,
    image_header,
    index_folder,
)
from utils.datasets.mask_values import MaskPair, MaskScan, format_examples, scan_masks
from utils.datasets.pairing import suffix_from_names
from utils.datasets.pools import pool_context
from utils.datasets.splits import (
    SPLIT_RULES,
    SplitRule,
    check_split_flags,
    split_positions,
)
from utils.errors import USER_ERROR_EXIT_CODE, ConfigError, DatasetError, UserError, user_message

logger = logging.getLogger(__name__)

PROBLEMS_EXIT_CODE = 1
MAX_DEFAULT_WORKERS = 8
# Below this many pairs a pool costs more to start than it saves.
MIN_PAIRS_FOR_POOL = 32


@dataclass(frozen=True)
class CheckSettings:
    """What to check (from the command line)."""

    imgs: Path
    masks: Path
    classes: int | None = None
    ignore_values: tuple[int, ...] = ()
    split: SplitRule | None = None
    """With --split-by: the split whose train/validation line duplicates must not cross."""
    workers: int | None = None
    cache_dir: Path | None = None
    """The mask-value cache folder; None: the one training uses."""


@dataclass(frozen=True)
class Finding:
    """One kind of problem (or warning): how many, the first few files, and what to do."""

    kind: str
    count: int
    what: str
    examples: tuple[str, ...]
    fix: str

    def line(self) -> str:
        examples = f": {format_examples(list(self.examples))}" if self.examples else ""
        return f"{self.kind}: {self.count} {self.what}{examples}; {self.fix}"


@dataclass
class CheckReport:
    """Everything the check found; ``problems`` stop training, ``warnings`` do not."""

    n_images: int = 0
    n_pairs: int = 0
    problems: list[Finding] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)
    mask_values: list = field(default_factory=list)
    class_shares: list[tuple[object, float]] = field(default_factory=list)
    """``(mask value, share of the non-void pixels)`` per class, in class order."""
    void_share: float = 0.0
    seconds: float = 0.0

    @property
    def trainable(self) -> bool:
        return not self.problems


class _PairFacts(NamedTuple):
    """What one worker learnt about one image and its mask (errors as text, so every bad file is reported)."""

    name: str
    image_sha256: str | None
    image_size: tuple[int, int] | None
    mask_size: tuple[int, int] | None
    orientation: int | None
    image_error: str | None
    mask_error: str | None


def check_dataset(settings: CheckSettings) -> CheckReport:
    """Read the folders once and report every problem found; a DatasetError only when a folder cannot be listed."""
    started = time.perf_counter()
    report = CheckReport()
    images = index_folder(settings.imgs, "image")
    masks = index_folder(settings.masks, "mask")
    if not images:
        raise DatasetError(f"no images in {settings.imgs}; point --imgs at the folder of training images")
    report.n_images = len(images)
    suffix = suffix_from_names(images.keys(), masks.keys())
    pairs = [MaskPair(name, images[name], masks[name + suffix]) for name in sorted(images) if name + suffix in masks]
    report.n_pairs = len(pairs)
    missing = sorted(images[name].name for name in images if name + suffix not in masks)
    if missing:
        report.problems.append(
            Finding(
                "pairing",
                len(missing),
                f"image(s) without a mask named <id>{suffix}.<ext>",
                tuple(missing),
                "add their masks or remove those images",
            )
        )
    used = {name + suffix for name in images}
    orphans = sorted(info.name for stem, info in masks.items() if stem not in used)
    if orphans:
        report.warnings.append(
            Finding(
                "pairing",
                len(orphans),
                "mask(s) without an image (ignored by training)",
                tuple(orphans),
                "remove them or add their images",
            )
        )
    empty = sorted(info.path for pair in pairs for info in (pair.image, pair.mask) if info.size == 0)
    if empty:
        report.problems.append(
            Finding("empty files", len(empty), "file(s) of 0 bytes", tuple(empty), "copy them again or delete them")
        )
    facts = _inspect_all([pair for pair in pairs if pair.image.size and pair.mask.size], settings.workers)
    _report_files(report, facts, {pair.name: pair for pair in pairs})
    good = {fact.name for fact in facts if _is_good(fact)}
    if good:  # the values of the usable pairs, whatever else is wrong: one run reports every kind of problem
        _report_mask_values(report, [pair for pair in pairs if pair.name in good], settings)
    _report_duplicates(report, facts, sorted(images), settings.split)
    report.seconds = time.perf_counter() - started
    return report


def _inspect_all(pairs: Sequence[MaskPair], workers: int | None) -> list[_PairFacts]:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    count = workers or min(cpus, MAX_DEFAULT_WORKERS)
    if count <= 1 or len(pairs) < MIN_PAIRS_FOR_POOL:
        return [_inspect_pair(pair) for pair in pairs]
    chunksize = max(1, len(pairs) // (count * 8))
    with ProcessPoolExecutor(max_workers=count, mp_context=pool_context()) as pool:
        return list(pool.map(_inspect_pair, pairs, chunksize=chunksize))


def _inspect_pair(pair: MaskPair) -> _PairFacts:
    """Hash the photo's bytes, read its EXIF orientation and both files' sizes from their headers."""
    digest = orientation = image_size = mask_size = image_error = mask_error = None
    try:
        data = Path(pair.image.path).read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        # As training loads it: turned upright by its EXIF orientation (headers only; the bytes are in the page cache).
        image_size = image_header(pair.image.path)[:2]
        if pair.image.ext not in ARRAY_EXTENSIONS:
            with Image.open(pair.image.path) as img:
                orientation = exif_orientation(img)
    except UNREADABLE_FILE_ERRORS as error:
        image_error = f"{pair.image.path} ({_reason(error)})"
    try:
        mask_size = image_header(pair.mask.path)[:2]
    except (*UNREADABLE_FILE_ERRORS, DatasetError) as error:
        mask_error = f"{pair.mask.path} ({_reason(error)})"
    return _PairFacts(pair.name, digest, image_size, mask_size, orientation, image_error, mask_error)


def _reason(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _is_good(fact: _PairFacts) -> bool:
    return fact.image_error is None and fact.mask_error is None and fact.image_size == fact.mask_size


def _report_files(report: CheckReport, facts: list[_PairFacts], pairs: dict[str, MaskPair]) -> None:
    unreadable = sorted(error for fact in facts for error in (fact.image_error, fact.mask_error) if error)
    if unreadable:
        report.problems.append(
            Finding(
                "unreadable files",
                len(unreadable),
                "file(s) cannot be read as images",
                tuple(unreadable),
                "replace or delete them",
            )
        )
    mismatched = sorted(
        f"{pairs[f.name].mask.name} is {_wh(f.mask_size)} but {pairs[f.name].image.name} is {_wh(f.image_size)}"
        for f in facts
        if f.image_size and f.mask_size and f.image_size != f.mask_size
    )
    if mismatched:
        report.problems.append(
            Finding(
                "size mismatches",
                len(mismatched),
                "mask(s) differ in size from their image",
                tuple(mismatched),
                "each mask must have exactly its image's width and height",
            )
        )
    rotated = sorted(pairs[f.name].image.name for f in facts if f.orientation not in (None, 1))
    if rotated:
        report.warnings.append(
            Finding(
                "EXIF rotation",
                len(rotated),
                "photo(s) carry an EXIF orientation: training turns them upright, as viewers show them",
                tuple(rotated),
                "check their masks were drawn on the upright photos (a quarter turn shows as a size mismatch)",
            )
        )


def _report_mask_values(report: CheckReport, pairs: list[MaskPair], settings: CheckSettings) -> None:
    try:
        scan = scan_masks(pairs, cache_dir=settings.cache_dir, workers=settings.workers)
    except DatasetError as error:
        report.problems.append(Finding("masks", len(pairs), "mask(s) scanned", (), str(error)))
        return
    report.mask_values = list(scan.mask_values)
    kept, void, totals = _class_pixels(scan, settings.ignore_values)
    all_pixels = sum(totals) + void
    report.class_shares = [(scan.mask_values[k], totals[i] / max(sum(totals), 1)) for i, k in enumerate(kept)]
    report.void_share = void / max(all_pixels, 1)
    if settings.classes is not None:
        allowed = 2 if settings.classes == 1 else settings.classes
        if len(kept) > allowed:
            values = tuple(str(scan.mask_values[k]) for k in kept)
            report.problems.append(
                Finding(
                    "mask values",
                    len(kept),
                    f"distinct mask values but --classes {settings.classes} allows {allowed}",
                    values,
                    f"train with --classes {len(kept)} if each value is a class, or pass "
                    "the void values with --ignore-value",
                )
            )
    if len(kept) == 1:
        report.warnings.append(
            Finding(
                "mask values",
                1,
                "distinct mask value in every mask",
                (str(scan.mask_values[kept[0]]),),
                "there is nothing to learn: check --masks",
            )
        )


def _class_pixels(scan: MaskScan, ignore_values: Sequence[int]) -> tuple[list[int], int, list[int]]:
    """(scan indices of the class values, void pixels, pixels per class) over every mask."""
    kept = [k for k, value in enumerate(scan.mask_values) if value not in ignore_values]
    position = {k: i for i, k in enumerate(kept)}
    totals, void = [0] * len(kept), 0
    for counts in scan.value_counts.values():
        for k, pixels in counts:
            if k in position:
                totals[position[k]] += pixels
            else:
                void += pixels
    return kept, void, totals


def _report_duplicates(report: CheckReport, facts: list[_PairFacts], ids: list[str], rule: SplitRule | None) -> None:
    by_hash: dict[str, list[str]] = {}
    for fact in facts:
        if fact.image_sha256 is not None:
            by_hash.setdefault(fact.image_sha256, []).append(fact.name)
    duplicates = sorted(sorted(names) for names in by_hash.values() if len(names) > 1)
    if duplicates:
        report.warnings.append(
            Finding(
                "duplicates",
                sum(len(names) for names in duplicates),
                f"photos are exact copies of another ({len(duplicates)} group(s))",
                tuple(_copies(names) for names in duplicates),
                "delete the copies: they weigh twice in training",
            )
        )
    if rule is None or not duplicates:
        return
    train, validation = split_positions(ids, rule)
    side = {ids[p]: "train" for p in train} | {ids[p]: "validation" for p in validation}
    crossing = [names for names in duplicates if len({side.get(name) for name in names}) > 1]
    if crossing:
        report.warnings.append(
            Finding(
                "duplicates across the split",
                len(crossing),
                f"group(s) of identical photos are both in training and in validation under --split-by {rule.by}",
                tuple(_copies(names) for names in crossing),
                "delete the copies, or group them with --split-by prefix / --group-pattern",
            )
        )


def _copies(names: list[str], shown: int = 3) -> str:
    """``a = b = c`` for a group of identical photos, the rest counted: a group can hold thousands."""
    text = " = ".join(names[:shown])
    return text if len(names) <= shown else f"{text} (+{len(names) - shown} more)"


def _wh(size: tuple[int, int] | None) -> str:
    return "?" if size is None else f"{size[0]}x{size[1]}"


def format_report(report: CheckReport, settings: CheckSettings, *, strict: bool = False) -> list[str]:
    """The lines the command prints: a summary, the classes' shares, then one line per warning and problem."""
    lines = [
        f"{report.n_images} images in {settings.imgs}, {report.n_pairs} with a mask in {settings.masks} "
        f"(checked in {report.seconds:.1f} s)"
    ]
    if report.class_shares:
        shares = ", ".join(f"{value}: {100 * share:.2f}%" for value, share in report.class_shares)
        lines.append(f"mask values {report.mask_values}; pixels per class: {shares}")
        if settings.ignore_values:
            lines.append(f"void (--ignore-value): {100 * report.void_share:.2f}% of the pixels")
    lines += [("problem: " if strict else "warning: ") + finding.line() for finding in report.warnings]
    lines += ["problem: " + finding.line() for finding in report.problems]
    if report.trainable and not (strict and report.warnings):
        lines.append("OK: training would start on this data")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m utils.datasets.check",
        description="Check images and masks before training: pairing, readability, sizes, mask values, EXIF "
        "rotations, duplicates. Exit 0 when training would start, 1 with one line per problem.",
    )
    parser.add_argument("--imgs", required=True, type=Path, metavar="DIR", help="folder of images")
    parser.add_argument("--masks", required=True, type=Path, metavar="DIR", help="folder of masks")
    parser.add_argument("--classes", type=int, help="the --classes training will use (checks the mask values)")
    parser.add_argument("--ignore-value", type=int, action="append", default=[], metavar="V", help="void mask value")
    parser.add_argument("--split-by", choices=SPLIT_RULES, help="also check duplicates against this split")
    parser.add_argument("--group-pattern", metavar="REGEX", help="as train.py's --group-pattern")
    parser.add_argument("--validation", "-v", type=float, default=10.0, help="as train.py's --validation")
    parser.add_argument("--folds", type=int, default=0, help="as train.py's --folds")
    parser.add_argument("--fold", type=int, default=0, help="as train.py's --fold")
    parser.add_argument("--workers", type=int, help="reader processes (default: CPUs, at most 8)")
    parser.add_argument("--cache-dir", type=Path, help="mask-value cache folder (default: the one training uses)")
    parser.add_argument("--strict", action="store_true", help="count warnings (duplicates, EXIF) as problems")
    return parser


def settings_of(args: argparse.Namespace) -> CheckSettings:
    if args.classes is not None and args.classes < 1:
        raise ConfigError(f"--classes {args.classes}: use 1 (binary) or more")
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers {args.workers}: use 1 or more")
    split = None
    if args.split_by is not None:
        check_split_flags(args.split_by, args.group_pattern, args.folds, args.fold)
        if not 0 < args.validation < 100:
            raise ConfigError(f"--validation {args.validation:g}: use a percentage in (0, 100)")
        split = SplitRule(args.split_by, args.group_pattern, args.validation, args.folds, args.fold)
    return CheckSettings(
        imgs=args.imgs,
        masks=args.masks,
        classes=args.classes,
        ignore_values=tuple(args.ignore_value),
        split=split,
        workers=args.workers,
        cache_dir=args.cache_dir,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        settings = settings_of(args)
        report = check_dataset(settings)
    except UserError as error:
        # The same one line as utils.cli.print_error, which would import torch (through utils.hardware) for nothing.
        print(f"Error: {user_message(error)}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    print("\n".join(format_report(report, settings, strict=args.strict)))
    failed = not report.trainable or (args.strict and report.warnings)
    return PROBLEMS_EXIT_CODE if failed else 0


if __name__ == "__main__":
    sys.exit(main())
