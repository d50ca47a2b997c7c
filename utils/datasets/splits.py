"""Which images train and which validate: the split rules, k folds, and the split on record (``split.json``).

Rules (``--split-by``):

* ``image``: milesial's seeded random split over images (``random_split`` with a fixed seed), unchanged bit for bit;
* ``prefix``: every id whose group (the part before the last ``_``, Carvana's car id, or the first group of
  ``--group-pattern``) is the same lands on the same side, the validation share as close to ``--validation`` as whole
  groups allow.

``--folds N --fold K`` deals the groups (single images with ``image``) into N folds of near-equal image counts; fold K
validates, the others train. The N validation sets are disjoint and together hold every image.

Everything here is a pure function of the sorted ids and the flags, so every rank computes the same split without
talking to the others. ``split_dataset`` also refuses a split that leaves a side empty and warns about a poor one;
its ``SplitRecord`` is what a run writes to ``<run>/split.json`` and, as its sha256, into its checkpoints;
``evaluate.py --split`` reads it back.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import logging
import random
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from utils.datasets.image_files import format_examples
from utils.errors import ConfigError, DatasetError, shortened
from utils.flags import MUST_MATCH, flag
from utils.output_files import read_text

logger = logging.getLogger(__name__)

SPLIT_BY_IMAGE = "image"
SPLIT_BY_PREFIX = "prefix"
SPLIT_RULES = (SPLIT_BY_IMAGE, SPLIT_BY_PREFIX)
SPLIT_FILE_VERSION = 1
# milesial/Pytorch-UNet splits with random_split(..., generator=torch.Generator().manual_seed(0)); the same fixed seed
# keeps its validation set, and makes the split identical on every rank whatever --seed is.
SPLIT_SEED = 0


@dataclass
class SplitFlags:
    """The split's flags, declared once for train.py's data section and the dataset check's settings (each field's
    docstring is its help, ``utils.flags``); the split functions below take them whole."""

    validation: float = flag(10.0, "--validation", "-v", range="(0, 100)", resume=MUST_MATCH)
    """Percent of the data used as validation, in (0, 100)."""
    split_by: str = flag(SPLIT_BY_IMAGE, "--split-by", choices=SPLIT_RULES, resume=MUST_MATCH)
    """Train/validation split: 'image' (seeded random over images) or 'prefix' (ids sharing the part before the last
    '_', e.g. a Carvana car's 16 views, stay on one side)."""
    group_pattern: str | None = flag(None, "--group-pattern", metavar="REGEX", resume=MUST_MATCH)
    """With --split-by prefix: a regular expression whose first group is an id's group (default: the part before the
    last '_')."""
    folds: int = flag(0, "--folds", range="[0, inf)", resume=MUST_MATCH)
    """Cross-validation folds (0 = off; N >= 2: fold --fold validates)."""
    fold: int = flag(0, "--fold", range="[0, inf)", resume=MUST_MATCH)
    """The fold that validates, 0..--folds - 1."""


@dataclass(frozen=True)
class SplitRecord:
    """One run's split as written to ``split.json``: the ids of each side and the rule that made them."""

    rule: str
    seed: int
    validation_percent: int | float | None
    """--validation (a JSON number); None with folds (each fold validates about 1/N of the images)."""
    group_pattern: str | None
    folds: int
    fold: int | None
    train: tuple[str, ...]
    validation: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"version": SPLIT_FILE_VERSION, **dataclasses.asdict(self)}

    def file_text(self) -> str:
        """What the run writes to its ``split.json`` (``read_split_file`` reads it back)."""
        return json.dumps(self.as_dict(), indent=1) + "\n"

    @functools.cached_property
    def digest(self) -> str:
        """sha256 of the canonical JSON: equal digests mean the same images on the same sides, made the same way.

        Computed once per record (every checkpoint stores it).
        """
        canonical = json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


def check_split_flags(by: str, group_pattern: str | None, folds: int, fold: int) -> None:
    """Reject impossible split flags up front (``by`` is one of ``SPLIT_RULES``: the flag's choices); every message
    names the flag to change."""
    if group_pattern is not None:
        if by != SPLIT_BY_PREFIX:
            raise ConfigError("--group-pattern names the groups of --split-by prefix; add --split-by prefix")
        compile_group_pattern(group_pattern)
    if folds == 1 or folds < 0:
        raise ConfigError(f"--folds {folds}: use 2 or more (or 0, no folds)")
    if folds and not 0 <= fold < folds:
        raise ConfigError(f"--fold {fold} with --folds {folds}: use a fold in 0..{folds - 1}")
    if not folds and fold:
        raise ConfigError(f"--fold {fold} needs --folds N (the number of folds)")


def compile_group_pattern(pattern: str) -> re.Pattern[str]:
    try:
        compiled = re.compile(pattern)
    except re.error as error:
        raise ConfigError(f"--group-pattern {pattern!r} is not a regular expression ({error})") from None
    if compiled.groups < 1:
        raise ConfigError(f"--group-pattern {pattern!r} has no group: put the group id in parentheses, e.g. '^(.+)_'")
    return compiled


def prefix_of(image_id: str) -> str:
    """The part of an id before its last ``_`` (Carvana's car id); the whole id when it has none."""
    return image_id.rpartition("_")[0] or image_id


def groups_of(ids: Sequence[str], pattern: re.Pattern[str] | None = None) -> list[list[int]]:
    """The positions in ``ids`` of each group, groups in sorted order of their names (independent of how the ids
    were listed). An id's group is the first group of ``pattern`` where it matches (``re.search``), else its prefix.
    """
    groups: dict[str, list[int]] = {}
    for position, image_id in enumerate(ids):
        found = pattern.search(image_id) if pattern else None
        if pattern and (found is None or found.group(1) is None):
            raise DatasetError(
                f"image id {image_id!r} does not match --group-pattern {pattern.pattern!r}; fix the pattern so every "
                f"id in --imgs matches it"
            )
        groups.setdefault(found.group(1) if found else prefix_of(image_id), []).append(position)
    return [groups[name] for name in sorted(groups)]


def split_sizes(n_images: int, validation_percent: float) -> tuple[int, int]:
    """(validation, training) image counts of the ``image`` rule, rounded as milesial does."""
    n_val = int(n_images * (validation_percent / 100))
    return n_val, n_images - n_val


def _units(ids: Sequence[str], flags: SplitFlags) -> list[list[int]]:
    """What ``flags`` deal into folds or sides, as lists of positions: single images with ``image``, groups with
    ``prefix``."""
    if flags.split_by == SPLIT_BY_IMAGE:
        return [[position] for position in range(len(ids))]
    return groups_of(ids, compile_group_pattern(flags.group_pattern) if flags.group_pattern else None)


def split_positions(ids: Sequence[str], flags: SplitFlags) -> tuple[list[int], list[int]]:
    """(train, validation) positions in ``ids`` (the dataset's sorted ids) under ``flags``.

    Either side may come back empty (too few images or groups): ``split_dataset`` names the flag to change.
    """
    if flags.split_by == SPLIT_BY_IMAGE and not flags.folds:
        # Imported here: the dataset check's worker processes import this module and must not pay for importing torch.
        import torch
        from torch.utils.data import random_split

        n_val, n_train = split_sizes(len(ids), flags.validation)
        generator = torch.Generator().manual_seed(SPLIT_SEED)
        train_split, val_split = random_split(range(len(ids)), [n_train, n_val], generator=generator)
        return list(train_split), list(val_split)
    shuffled = _units(ids, flags)
    random.Random(SPLIT_SEED).shuffle(shuffled)
    if flags.folds:
        fold_of = assign_folds([len(group) for group in shuffled], flags.folds)
        chosen = [group for group, fold in zip(shuffled, fold_of, strict=True) if fold == flags.fold]
    else:
        target = len(ids) * flags.validation / 100
        chosen = [shuffled[k] for k in choose_validation([len(group) for group in shuffled], target)]
    validation = sorted(position for group in chosen for position in group)
    taken = set(validation)
    return [position for position in range(len(ids)) if position not in taken], validation


def choose_validation(sizes: Sequence[int], target: float) -> list[int]:
    """Indices of the groups (in the given, shuffled order) that validate: a greedy pass that takes a group when it
    brings the validation count closer to ``target``; at least one group, never all of them when there are two."""
    chosen, count = [], 0
    for index, size in enumerate(sizes):
        if abs(count + size - target) < abs(count - target):
            chosen.append(index)
            count += size
    if not chosen and sizes:
        chosen = [0]
    if len(chosen) == len(sizes) > 1:
        chosen.pop()
    return chosen


def assign_folds(sizes: Sequence[int], folds: int) -> list[int]:
    """The fold of each group (in the given, shuffled order): largest groups first, each to the fold with the fewest
    images so far (the lowest-numbered on a tie), so the folds' image counts differ by at most the largest group."""
    order = sorted(range(len(sizes)), key=lambda index: -sizes[index])  # stable: ties keep the shuffled order
    totals = [0] * folds
    fold_of = [0] * len(sizes)
    for index in order:
        fold = min(range(folds), key=lambda k: (totals[k], k))
        fold_of[index] = fold
        totals[fold] += sizes[index]
    return fold_of


def split_dataset(ids: Sequence[str], flags: SplitFlags, imgs: Path) -> tuple[list[int], list[int], SplitRecord]:
    """(train, validation) positions of the dataset's sorted ``ids`` (from the folder ``imgs``) under ``flags``, and
    their record (``split.json``).

    A ConfigError names the flag to change when a side is empty, or when more folds than images (or groups) leave a
    fold empty, whichever --fold this run is. One warning when whole groups validate more than twice the asked share,
    and one when the random split puts views of one thing (ids that look grouped) on both sides.
    """
    train, validation = split_positions(ids, flags)
    by, folds = flags.split_by, flags.folds
    n_units = len(_units(ids, flags))
    if not train or not validation or folds > n_units:
        kind = "images" if by == SPLIT_BY_IMAGE else "groups"
        if folds and n_units >= 2:
            fix = f"{n_units} {kind} cannot fill {folds} folds (a fold stays empty): use --folds {n_units} or fewer"
        elif by == SPLIT_BY_PREFIX:
            fix = f"the ids form {n_units} group(s), too few to split: use --split-by image or another --group-pattern"
        else:
            fix = "too few images to split" if folds else "choose a --validation that leaves at least one of each"
        asked = f"--split-by {by} " + (f"--folds {folds}" if folds else f"--validation {flags.validation:g}")
        raise ConfigError(
            f"{asked} leaves {len(train)} training and {len(validation)} validation images out of {len(ids)}: {fix} "
            f"(or add images to {imgs})"
        )
    share = 100 * len(validation) / len(ids)
    if by == SPLIT_BY_PREFIX and not folds and share > 2 * flags.validation:
        logger.warning(
            "--split-by prefix validates %d of %d images (%.0f%%) where --validation asked %g%%: the groups are too "
            "large to come closer; use a --group-pattern with smaller groups, or more groups of images",
            len(validation),
            len(ids),
            share,
            flags.validation,
        )
    validating = set(validation)
    groups = groups_of(ids) if by == SPLIT_BY_IMAGE else []  # what the random split may cut through: the prefixes
    spanning = sum(len({position in validating for position in group}) > 1 for group in groups)
    # The ids look grouped (several views of each thing): two or more prefixes, on average two ids or more each.
    if spanning and len(ids) >= 2 * len(groups) >= 4:
        logger.warning(
            "the image ids look grouped (%d ids share %d prefixes before their last '_', e.g. several views of one "
            "car) and the random split puts %d of those groups on both sides, so validation sees near-copies of "
            "training images; use --split-by prefix (docs/VALIDATION.md)",
            len(ids),
            len(groups),
            spanning,
        )
    record = SplitRecord(
        rule=by,
        seed=SPLIT_SEED,
        validation_percent=None if folds else flags.validation,
        group_pattern=flags.group_pattern,
        folds=folds,
        fold=flags.fold if folds else None,
        train=tuple(ids[p] for p in train),
        validation=tuple(ids[p] for p in validation),
    )
    return train, validation, record


def check_same_split(saved_digest: str | None, record: SplitRecord, path: str) -> None:
    """Refuse to resume ``path`` on another split: its trained images would start to validate, or the reverse."""
    if saved_digest is not None and saved_digest != record.digest:
        raise ConfigError(
            f"{path} was trained on another train/validation split than these flags make (--split-by, "
            f"--group-pattern, --validation, --folds, --fold, or other image ids); resume with the run's split flags "
            f"(its split.json records them), or start a new run from its weights with --load {path}"
        )


# A split file lists ids (tens of bytes each): 64 MiB is millions of images, and bounds what a wrong path can cost.
MAX_SPLIT_FILE_BYTES = 64 << 20
# The fields of a split file besides its id lists and their types: ``SplitRecord``'s (None where the rule leaves one
# unset).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    name: typing.get_args(hint) or (hint,)
    for name, hint in typing.get_type_hints(SplitRecord).items()
    if name not in ("train", "validation")
}


def read_split_file(path: Path) -> SplitRecord:
    """The split a run wrote to ``path``, every field typed and checked; a ConfigError naming ``--split`` otherwise.

    Refused: a file that is not a run's split.json (not JSON, no id lists, another version), a field of the wrong
    type (``"seed": "abc"``), no validation ids, an id listed twice (it would be scored twice) or on both sides.
    """
    where = f"--split {path}"
    text = read_text(
        path, where, MAX_SPLIT_FILE_BYTES, f"{MAX_SPLIT_FILE_BYTES >> 20} MiB; pass the split.json of a run folder"
    )
    try:
        raw = json.loads(text)
    except (RecursionError, ValueError) as error:
        reason = " ".join(str(error).split())[:120]
        raise ConfigError(f"{where} is not JSON ({reason}); pass the split.json of a run folder") from None
    if not isinstance(raw, dict) or not all(isinstance(raw.get(key), list) for key in ("train", "validation")):
        raise ConfigError(f"{where} has no 'train' and 'validation' id lists; pass the split.json of a run folder")
    if raw.get("version") != SPLIT_FILE_VERSION or isinstance(raw.get("version"), bool):
        raise ConfigError(
            f"{where} has format version {shortened(raw.get('version'), 60)}; this version reads version 1"
        )
    for key, types in _FIELD_TYPES.items():
        value = raw.get(key)
        if key not in raw or isinstance(value, bool) or not isinstance(value, types):
            kind = " or ".join("null" if kind is type(None) else kind.__name__ for kind in types)
            raise ConfigError(
                f"{where}: {key} must be {kind}, got {shortened(value, 60)}; the file is damaged or was edited"
            )
    if raw["rule"] not in SPLIT_RULES or raw["folds"] < 0:
        raise ConfigError(
            f"{where}: rule {shortened(raw['rule'], 60)} / folds {raw['folds']} is not a split this makes"
        )
    listed = raw["train"] + raw["validation"]
    if not all(isinstance(image_id, str) for image_id in listed):
        raise ConfigError(f"{where}: the train and validation ids must be text; the file is damaged or was edited")
    repeated = sorted(image_id for image_id, times in collections.Counter(listed).items() if times > 1)
    if repeated:
        raise ConfigError(
            f"{where} lists {len(repeated)} id(s) more than once, on one side or both ({format_examples(repeated)}); "
            "each image is on one side once, the file was edited: pass the split.json the run wrote"
        )
    if not raw["validation"]:
        raise ConfigError(f"{where} lists no validation images; pass the split.json of a run that validated")
    return SplitRecord(
        **{key: raw[key] for key in _FIELD_TYPES}, train=tuple(raw["train"]), validation=tuple(raw["validation"])
    )
