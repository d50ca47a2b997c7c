"""Which images train and which validate: the split rules, k folds, and the split on record (``split.json``).

Rules (``--split-by``):

* ``image``: milesial's seeded random split over images (``random_split`` with a fixed seed), unchanged bit for bit;
* ``prefix``: every id whose group (the part before the last ``_``, Carvana's car id, or the first group of
  ``--group-pattern``) is the same lands on the same side, the validation share as close to ``--validation`` as whole
  groups allow.

``--folds N --fold K`` deals the groups (single images with ``image``) into N folds of near-equal image counts; fold K
validates, the others train. The N validation sets are disjoint and together hold every image.

Everything here is a pure function of the sorted ids and the rule, so every rank computes the same split without
talking to the others. ``SplitRecord`` is what a run writes to ``<run>/split.json`` and, as its sha256, into its
checkpoints; ``evaluate.py --split`` reads it back.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
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
from utils.output_files import OutputError, read_text, write_text

SPLIT_BY_IMAGE = "image"
SPLIT_BY_PREFIX = "prefix"
SPLIT_RULES = (SPLIT_BY_IMAGE, SPLIT_BY_PREFIX)
SPLIT_FILE_VERSION = 1
# milesial/Pytorch-UNet splits with random_split(..., generator=torch.Generator().manual_seed(0)); the same fixed seed
# keeps its validation set, and makes the split identical on every rank whatever --seed is.
SPLIT_SEED = 0


@dataclass(frozen=True)
class SplitRule:
    """How to split (from --split-by, --group-pattern, --validation, --folds, --fold)."""

    by: str = SPLIT_BY_IMAGE
    group_pattern: str | None = None
    """A regular expression whose first group is an id's group (``prefix`` only); None: the part before the last _."""
    validation: float = 10.0
    """Percent of the images that validate (without folds)."""
    folds: int = 0
    """0: one split by ``validation``; N >= 2: fold ``fold`` of N validates."""
    fold: int = 0
    seed: int = SPLIT_SEED


@dataclass
class SplitFlags:
    """The split's flags, declared once for train.py's data section and the dataset check's settings (each field's
    docstring is its help, ``utils.flags``)."""

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

    def split_rule(self) -> SplitRule:
        """The rule of these flags (checked together by ``check_split_flags``); the seed stays ``SPLIT_SEED``."""
        return SplitRule(self.split_by, self.group_pattern, self.validation, self.folds, self.fold)


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


def group_of(image_id: str, pattern: re.Pattern[str] | None) -> str:
    """The group of an id: the first group of ``pattern`` where it matches (``re.search``), else its prefix."""
    if pattern is None:
        return prefix_of(image_id)
    found = pattern.search(image_id)
    if found is None or found.group(1) is None:
        raise DatasetError(
            f"image id {image_id!r} does not match --group-pattern {pattern.pattern!r}; fix the pattern so every id "
            f"in --imgs matches it"
        )
    return found.group(1)


def groups_of(ids: Sequence[str], pattern: re.Pattern[str] | None = None) -> dict[str, list[int]]:
    """Group name -> positions in ``ids``, groups in sorted order (independent of how the ids were listed)."""
    groups: dict[str, list[int]] = {}
    for position, image_id in enumerate(ids):
        groups.setdefault(group_of(image_id, pattern), []).append(position)
    return {name: groups[name] for name in sorted(groups)}


def split_sizes(n_images: int, validation_percent: float) -> tuple[int, int]:
    """(validation, training) image counts of the ``image`` rule, rounded as milesial does."""
    n_val = int(n_images * (validation_percent / 100))
    return n_val, n_images - n_val


def split_positions(ids: Sequence[str], rule: SplitRule) -> tuple[list[int], list[int]]:
    """(train, validation) positions in ``ids`` (the dataset's sorted ids) under ``rule``.

    Either side may come back empty (too few images or groups); the caller names the flag to change.
    """
    if rule.by == SPLIT_BY_IMAGE and not rule.folds:
        return _random_image_split(len(ids), rule.validation, rule.seed)
    shuffled = _units(ids, rule)
    random.Random(rule.seed).shuffle(shuffled)
    if rule.folds:
        fold_of = assign_folds([len(group) for group in shuffled], rule.folds)
        chosen = [group for group, fold in zip(shuffled, fold_of, strict=True) if fold == rule.fold]
    else:
        target = len(ids) * rule.validation / 100
        chosen = [shuffled[k] for k in choose_validation([len(group) for group in shuffled], target)]
    validation = sorted(position for group in chosen for position in group)
    taken = set(validation)
    return [position for position in range(len(ids)) if position not in taken], validation


def _random_image_split(n_images: int, validation_percent: float, seed: int) -> tuple[list[int], list[int]]:
    # Imported here: the dataset check's worker processes import this module and must not pay for importing torch.
    import torch
    from torch.utils.data import random_split

    n_val, n_train = split_sizes(n_images, validation_percent)
    if n_val == 0 or n_train == 0:
        return (list(range(n_images)), []) if n_val == 0 else ([], list(range(n_images)))
    generator = torch.Generator().manual_seed(seed)
    train_split, val_split = random_split(range(n_images), [n_train, n_val], generator=generator)
    return list(train_split), list(val_split)


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


def _units(ids: Sequence[str], rule: SplitRule) -> list[list[int]]:
    """What ``rule`` deals into folds or sides, as lists of positions: single images with ``image``, groups with
    ``prefix``."""
    if rule.by == SPLIT_BY_IMAGE:
        return [[position] for position in range(len(ids))]
    return list(groups_of(ids, compile_group_pattern(rule.group_pattern) if rule.group_pattern else None).values())


def group_count(ids: Sequence[str], rule: SplitRule) -> int:
    """How many units ``rule`` deals into folds or sides: images with ``image``, groups with ``prefix``."""
    return len(_units(ids, rule))


def empty_side_fix(ids: Sequence[str], rule: SplitRule) -> str:
    """What to change when ``rule`` left a side empty: the flag and the value that would leave both sides images."""
    units = group_count(ids, rule)
    kind = "images" if rule.by == SPLIT_BY_IMAGE else "groups"
    if rule.folds and units >= 2:
        return f"{units} {kind} cannot fill {rule.folds} folds (a fold stays empty): use --folds {units} or fewer"
    if rule.by == SPLIT_BY_PREFIX:
        return f"the ids form {units} group(s), too few to split: use --split-by image or another --group-pattern"
    return "too few images to split"


def validation_share_warning(n_images: int, n_validation: int, rule: SplitRule) -> str | None:
    """A line when whole groups put more than twice the asked ``--validation`` share into validation, else None."""
    if rule.folds or rule.by != SPLIT_BY_PREFIX or n_images == 0:
        return None
    share = 100 * n_validation / n_images
    if share <= 2 * rule.validation:
        return None
    return (
        f"--split-by prefix validates {n_validation} of {n_images} images ({share:.0f}%) where --validation asked "
        f"{rule.validation:g}%: the groups are too large to come closer; use a --group-pattern with smaller groups, "
        f"or more groups of images"
    )


def groups_on_both_sides(groups: Sequence[Sequence[int]], validation: Sequence[int]) -> list[int]:
    """Indices of the groups (lists of positions) with members both in ``validation`` and in training (the rest)."""
    validating = set(validation)
    return [index for index, group in enumerate(groups) if len({p in validating for p in group}) > 1]


def groups_across(ids: Sequence[str], train: Sequence[int], validation: Sequence[int]) -> tuple[int, int]:
    """(prefix groups with ids on both sides, prefix groups in all) of a split (``train``: the other positions)."""
    groups = list(groups_of(ids).values())
    return len(groups_on_both_sides(groups, validation)), len(groups)


def looks_grouped(ids: Sequence[str]) -> bool:
    """Whether the ids look like several views of each thing: two or more prefixes, on average two ids or more each."""
    n_groups = len(groups_of(ids))
    return n_groups >= 2 and len(ids) >= 2 * n_groups


def make_record(ids: Sequence[str], rule: SplitRule, train: Sequence[int], validation: Sequence[int]) -> SplitRecord:
    return SplitRecord(
        rule=rule.by,
        seed=rule.seed,
        validation_percent=None if rule.folds else rule.validation,
        group_pattern=rule.group_pattern,
        folds=rule.folds,
        fold=rule.fold if rule.folds else None,
        train=tuple(ids[p] for p in train),
        validation=tuple(ids[p] for p in validation),
    )


def check_same_split(saved_digest: str | None, record: SplitRecord, path: str) -> None:
    """Refuse to resume ``path`` on another split: its trained images would start to validate, or the reverse."""
    if saved_digest is not None and saved_digest != record.digest:
        raise ConfigError(
            f"{path} was trained on another train/validation split than these flags make (--split-by, "
            f"--group-pattern, --validation, --folds, --fold, or other image ids); resume with the run's split flags "
            f"(its split.json records them), or start a new run from its weights with --load {path}"
        )


def write_split_file(path: Path, record: SplitRecord) -> None:
    """Write ``record`` as JSON to ``path`` all or nothing (``output_files.write_text``); a failure names the file."""
    try:
        write_text(path, json.dumps(record.as_dict(), indent=1) + "\n")
    except OutputError as error:
        cause = error.__cause__
        raise ConfigError(
            f"could not write the split to {path}: {getattr(cause, 'strerror', None) or cause}; choose a writable "
            "--checkpoint-dir"
        ) from cause


# A split file lists ids (tens of bytes each): 64 MiB is millions of images, and bounds what a wrong path can cost.
MAX_SPLIT_FILE_BYTES = 64 << 20
# The fields of a split file besides its id lists and their types: ``SplitRecord``'s (None where the rule leaves one
# unset).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    name: typing.get_args(hint) or (hint,)
    for name, hint in typing.get_type_hints(SplitRecord).items()
    if name not in ("train", "validation")
}


def read_split_file(path: Path, flag: str = "--split") -> SplitRecord:
    """The split a run wrote to ``path``, every field typed and checked; a ConfigError naming ``flag`` otherwise.

    Refused: a file that is not a run's split.json (not JSON, no id lists, another version), a field of the wrong
    type (``"seed": "abc"``), no validation ids, an id listed twice (it would be scored twice), an id on both sides.
    """
    where = f"{flag} {path}"
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
    sides = {}
    for side in ("train", "validation"):
        ids = raw[side]
        if not all(isinstance(image_id, str) for image_id in ids):
            raise ConfigError(f"{where}: the {side} ids must be text; the file is damaged or was edited")
        repeated = sorted(image_id for image_id, times in collections.Counter(ids).items() if times > 1)
        if repeated:
            raise ConfigError(
                f"{where} lists {len(repeated)} {side} id(s) more than once ({format_examples(repeated)}); each "
                f"image is on one side once, the file was edited: pass the split.json the run wrote"
            )
        sides[side] = tuple(ids)
    if not sides["validation"]:
        raise ConfigError(f"{where} lists no validation images; pass the split.json of a run that validated")
    both = sorted(set(sides["train"]) & set(sides["validation"]))
    if both:
        raise ConfigError(
            f"{where} puts {len(both)} id(s) on both sides ({format_examples(both)}); the file was edited: pass the "
            "split.json the run wrote"
        )
    return SplitRecord(**{key: raw[key] for key in _FIELD_TYPES}, **sides)


OTHER_SPLIT_FLAG = "--other-split"


def validation_positions(
    ids: Sequence[str], split_file: Path, *, trained_on: str | None = None, model: Any = None, other_split: bool = False
) -> list[int]:
    """Positions in ``ids`` of the validation images of the run that wrote ``split_file`` (evaluate.py --split).

    ``trained_on`` is the split digest the checkpoint ``model`` records (None: not recorded): another split is
    refused unless ``other_split`` (its validation images may be the model's training images).
    """
    record = read_split_file(split_file)
    if trained_on is not None and record.digest != trained_on and not other_split:
        raise ConfigError(
            f"--split {split_file} is not the split {model} was trained on (its recorded split_sha256 differs), so "
            f"its validation images may be training images of the model; pass the split.json of the model's run "
            f"folder, or add {OTHER_SPLIT_FLAG} to score this split anyway"
        )
    return positions_of(ids, record.validation, f"--split {split_file}")


def positions_of(ids: Sequence[str], wanted: Sequence[str], source: str) -> list[int]:
    """Positions in ``ids`` of the ``wanted`` ids; a DatasetError naming ``source`` when some are missing."""
    position = {image_id: index for index, image_id in enumerate(ids)}
    missing = [image_id for image_id in wanted if image_id not in position]
    if missing:
        raise DatasetError(
            f"{len(missing)} of the {len(wanted)} validation images of {source} are not in the folders given: "
            f"{format_examples(missing)}; pass the --imgs and --masks the run was trained on"
        )
    return sorted(position[image_id] for image_id in wanted)
