"""``python -m utils.datasets.check``: check a dataset before a long run, reading every file once, in parallel.

    python -m utils.datasets.check --imgs data/imgs --masks data/masks [--classes K] [--ignore-value V]
                                   [--split-by prefix] [--validation 10] [--folds N --fold K] [--strict]

Reports pairing problems (images without a mask, masks without an image, empty files), unreadable files, masks whose
size differs from their image, the mask values and each class's share of the pixels, photos with an EXIF rotation,
exact duplicate photos (same bytes) and, with ``--split-by``, duplicates that land on both sides of the
train/validation line. The mask values come from the same cached scan as training (``utils.datasets.mask_values``),
so a second check of unchanged folders (and the training start after it) decodes no mask again.

Exit status: 0 when training would start (warnings are printed and do not count unless ``--strict``), 1 with one
``problem:`` line per kind of problem (its count and the first few files), 2 for a bad flag, a missing or empty
folder, or one folder given for both images and masks.
Like the mask scan, this module does not import torch (its workers start fast).
"""

from __future__ import annotations

import hashlib
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from utils.cli import print_error
from utils.datasets.image_files import (
    ARRAY_EXTENSIONS,
    UNREADABLE_FILE_ERRORS,
    Finding,
    MaskPair,
    exif_orientation,
    format_examples,
    open_pil,
    pair_folders,
    pool_map,
)
from utils.datasets.mask_values import class_totals, class_value_findings, scan_masks
from utils.datasets.splits import SPLIT_BY_PREFIX, SPLIT_RULES, SplitFlags, check_split_flags, split_positions
from utils.errors import USER_ERROR_EXIT_CODE, UserError, count
from utils.flags import FlagParser, flag

PROBLEMS_EXIT_CODE = 1


@dataclass
class CheckSettings(SplitFlags):
    """What to check: the command line's flags (``utils.flags``; each docstring is the flag's help), the split's
    train.py's own (``SplitFlags``)."""

    imgs: Path = flag(None, "--imgs", metavar="DIR", required=True)
    """folder of images"""
    masks: Path = flag(None, "--masks", metavar="DIR", required=True)
    """folder of masks"""
    classes: int | None = flag(None, "--classes", range="[1, inf)")
    """the --classes training will use (checks the mask values)"""
    ignore_values: list[int] = flag([], "--ignore-value", metavar="V")
    """void mask value"""
    split_by: str | None = flag(None, "--split-by", choices=SPLIT_RULES)  # type: ignore[assignment]
    """also check duplicates against this split ('image' or 'prefix', as train.py's --split-by)"""
    workers: int | None = flag(None, "--workers", range="[1, inf)")
    """reader processes (default: CPUs, at most 8)"""
    cache_dir: Path | None = flag(None, "--cache-dir")
    """mask-value cache folder (default: the one training uses)"""
    strict: bool = flag(False, "--strict")
    """count warnings (duplicates, EXIF) as problems"""


@dataclass
class CheckReport:
    """Everything the check found: what it read (the lines printed first), ``problems`` (they stop training) and
    ``warnings`` (they do not)."""

    summary: list[str]
    problems: list[Finding]
    warnings: list[Finding]

    def passes(self, strict: bool) -> bool:
        """Whether training would start on this data (and, ``strict``, nothing was found even to warn about)."""
        return not self.problems and not (strict and self.warnings)

    def lines(self, strict: bool) -> list[str]:
        """The lines the command prints: the summary, then one line per warning and problem (``strict``: the
        warnings are problems too), and OK when training would start."""
        warning = "problem" if strict else "warning"
        lines = [*self.summary, *(f"{warning}: {found.kind}: {found.sentence()}" for found in self.warnings)]
        lines += [f"problem: {found.kind}: {found.sentence()}" for found in self.problems]
        return lines + (["OK: training would start on this data"] if self.passes(strict) else [])


def check_dataset(settings: CheckSettings) -> CheckReport:
    """Read the folders once and report every problem found; a DatasetError or ConfigError only when the split flags
    are impossible together, or a folder cannot be listed, holds no images or masks, or is both
    (``image_files.pair_folders``, the dataset's own pairing)."""
    started = time.perf_counter()
    if settings.split_by is not None:  # the split's flags together (each one's range: parse_flags), before any file
        check_split_flags(settings.split_by, settings.group_pattern, settings.folds, settings.fold)
    pairing = pair_folders(settings.imgs, settings.masks, None)
    report = CheckReport([], pairing.problems, pairing.warnings)
    pairs = [pair for pair in pairing.pairs if pair.image.size and pair.mask.size]
    if pairs:  # the values of the usable pairs, whatever else is wrong: one run reports every kind of problem
        _report_mask_values(report, pairs, settings)
    _report_photos(report, pairs, sorted(pairing.images), settings)
    seconds = time.perf_counter() - started
    read = f"{len(pairing.images)} images in {settings.imgs}, {len(pairing.pairs)} with a mask in {settings.masks}"
    report.summary.insert(0, f"{read} (checked in {seconds:.1f} s)")
    return report


def _inspect_photo(pair: MaskPair) -> tuple[str | None, int | None]:
    """The sha256 of the photo's bytes and its EXIF orientation, read from its header."""
    try:
        digest = hashlib.sha256(Path(pair.image.path).read_bytes()).hexdigest()
        if pair.image.ext in ARRAY_EXTENSIONS:
            return digest, None
        with open_pil(pair.image.path, any_size=True) as img:  # the bytes are in the page cache now; a header only
            return digest, exif_orientation(img)
    except UNREADABLE_FILE_ERRORS:
        return None, None


def _report_mask_values(report: CheckReport, pairs: list[MaskPair], settings: CheckSettings) -> None:
    """The mask values, each class's share of the non-void pixels (and the void share), and the class-value rules."""
    scan = scan_masks(pairs, cache_dir=settings.cache_dir, workers=settings.workers)
    report.problems += scan.problems
    values, per_image, void = scan.classes(settings.ignore_values)
    totals = class_totals(per_image.values(), len(values))
    shares = (
        f"{value}: {100 * pixels / max(sum(totals), 1):.2f}%" for value, pixels in zip(values, totals, strict=True)
    )
    report.summary.append(f"mask values {list(scan.mask_values)}; pixels per class: {', '.join(shares)}")
    if settings.ignore_values:
        report.summary.append(f"void (--ignore-value): {100 * void / max(sum(totals) + void, 1):.2f}% of the pixels")
    problems, warnings = class_value_findings(values, pairs, settings.masks, settings.classes, settings.ignore_values)
    report.problems += problems
    report.warnings += warnings


def _report_photos(report: CheckReport, pairs: list[MaskPair], ids: list[str], settings: CheckSettings) -> None:
    """EXIF rotations, exact duplicates and, with --split-by, the duplicates on both sides of the split."""
    # Per pair: the photo's sha256 and EXIF orientation (None when unreadable: the mask scan reports those).
    facts = list(zip(pairs, pool_map(_inspect_photo, pairs, settings.workers), strict=True))
    rotated = sorted(pair.image.name for pair, (_, orientation) in facts if orientation not in (None, 1))
    if rotated:
        what = f"{len(rotated)} photo(s) carry an EXIF orientation: training turns them upright, as viewers show them"
        fix = "check their masks were drawn on the upright photos (a quarter turn shows as a size mismatch)"
        report.warnings.append(Finding("EXIF rotation", what, tuple(rotated), fix))
    by_hash: dict[str, list[str]] = {}
    for pair, (digest, _) in facts:
        if digest is not None:
            by_hash.setdefault(digest, []).append(pair.name)
    duplicates = sorted(sorted(names) for names in by_hash.values() if len(names) > 1)
    if not duplicates:
        return
    copies = sum(len(names) - 1 for names in duplicates)  # a group of n identical photos: one and n-1 copies
    verb = "is an exact copy of another" if copies == 1 else "are exact copies of others"
    what = f"{count(copies, 'photo')} {verb} ({count(len(duplicates), 'group')} of identical photos)"
    fix = "delete the copies: they weigh twice in training"
    report.warnings.append(Finding("duplicates", what, _copies(duplicates), fix))
    if settings.split_by is None:
        return
    validation = {ids[position] for position in split_positions(ids, settings)[1]}
    crossing = [names for names in duplicates if len({name in validation for name in names}) > 1]
    if crossing:
        what = f"{len(crossing)} group(s) of identical photos are both in training and in validation under --split-by "
        # Under --split-by prefix these copies have different prefixes: only a pattern can group them.
        by_prefix = settings.split_by == SPLIT_BY_PREFIX
        fix = "delete the copies, or group them with " + (
            "a --group-pattern" if by_prefix else "--split-by prefix / --group-pattern"
        )
        report.warnings.append(Finding("duplicates across the split", what + settings.split_by, _copies(crossing), fix))


def _copies(groups: list[list[str]]) -> tuple[str, ...]:
    """``a = b = c`` for each group of identical photos, the rest counted: a group can hold thousands."""
    return tuple(format_examples(names, 3, " = ") for names in groups)


def main(argv: Sequence[str] | None = None) -> int:
    parser = FlagParser(
        CheckSettings,
        prog="-m utils.datasets.check",
        description="Check images and masks before training: pairing, readability, sizes, mask values, EXIF "
        "rotations, duplicates. Exit 0 when training would start, 1 with one line per problem.",
    )
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        settings = parser.parse(argv)
        report = check_dataset(settings)
    except UserError as error:
        print_error(error)
        return USER_ERROR_EXIT_CODE
    print("\n".join(report.lines(settings.strict)))
    return 0 if report.passes(settings.strict) else PROBLEMS_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
