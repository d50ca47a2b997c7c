"""Tests for utils.datasets.splits: the split rules and folds on hand-made id lists, and the split file."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import random_split

from utils.checkpoint.files import write_run_text
from utils.datasets import splits
from utils.datasets.splits import (
    MAX_SPLIT_FILE_BYTES,
    SplitFlags,
    assign_folds,
    check_same_split,
    check_split_flags,
    choose_validation,
    groups_of,
    prefix_of,
    read_split_file,
    split_dataset,
    split_positions,
)
from utils.errors import ConfigError, DatasetError
from utils.inference.config import EvaluateConfig
from utils.inference.engine import validation_subset


def carvana_ids(cars: int, views: int) -> list[str]:
    return sorted(f"car{car:03d}_{view + 1:02d}" for car in range(cars) for view in range(views))


def sides(ids: list[str], positions: list[int]) -> set[str]:
    return {prefix_of(ids[p]) for p in positions}


def scored_ids(ids: list[str], split: Path, trained_on: str | None = None, other_split: bool = False) -> list[str]:
    """The ids of ``ids`` that ``evaluate.py --split split`` scores (``engine.validation_subset``, which reads the
    dataset's ids only), for a checkpoint ``m.pth`` whose recorded split digest is ``trained_on``."""
    config = EvaluateConfig(model=Path("m.pth"), split_path=split, other_split=other_split)
    subset = validation_subset(SimpleNamespace(ids=ids), config, trained_on)
    return [ids[position] for position in subset.indices]


def warnings_of(caplog: pytest.LogCaptureFixture, ids: list[str], flags: SplitFlags) -> list[str]:
    """The warnings ``split_dataset`` logs for ``ids`` under ``flags``."""
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        split_dataset(ids, flags, Path("imgs"))
    return [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]


def test_prefix_and_pattern_groups() -> None:
    assert prefix_of("0cdf5b5d0ce1_01") == "0cdf5b5d0ce1"
    assert prefix_of("a_b_c") == "a_b"
    assert prefix_of("plain") == "plain"
    assert groups_of(["b_02", "a_01", "b_01", "plain"]) == [[1], [0, 2], [3]]  # groups a, b, plain: sorted names
    pattern = re.compile(r"^patient(\d+)-")
    assert groups_of(["patient3-x", "patient12-slice003", "patient12-slice004"], pattern) == [[1, 2], [0]]  # "12", "3"
    with pytest.raises(DatasetError, match=r"'other' does not match --group-pattern"):
        groups_of(["patient3-x", "other"], pattern)


def test_image_rule_is_the_old_random_split_bit_for_bit() -> None:
    ids = [f"img{index:03d}" for index in range(37)]
    train, validation = split_positions(ids, SplitFlags(validation=20.0))
    old_train, old_val = random_split(range(37), [30, 7], generator=torch.Generator().manual_seed(0))
    assert train == list(old_train) and validation == list(old_val)


def test_prefix_rule_keeps_each_group_on_one_side_near_the_share(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = carvana_ids(12, 4)
    flags = SplitFlags(split_by="prefix", validation=25.0)
    train, validation = split_positions(ids, flags)
    assert sides(ids, train).isdisjoint(sides(ids, validation))
    assert sorted(train + validation) == list(range(48))
    assert len(validation) == 12  # 25 % of 48 is exactly three cars
    assert split_positions(ids, flags) == (train, validation)  # deterministic
    monkeypatch.setattr(splits, "SPLIT_SEED", 1)  # the groups are shuffled by the seed
    other_seed = split_positions(ids, flags)
    assert other_seed[1] != validation and len(other_seed[1]) == 12


def test_image_rule_on_grouped_ids_crosses_groups_and_is_detected(caplog: pytest.LogCaptureFixture) -> None:
    ids = carvana_ids(12, 4)
    _, validation = split_positions(ids, SplitFlags(validation=25.0))
    # Car k's four views are positions 4k..4k+3 of the sorted ids.
    spanning = sum(len({p in validation for p in range(4 * car, 4 * car + 4)}) > 1 for car in range(12))
    assert spanning > 0
    (line,) = warnings_of(caplog, ids, SplitFlags(validation=25.0))
    assert "look grouped (48 ids share 12 prefixes" in line and f"puts {spanning} of those groups on both" in line
    assert not warnings_of(caplog, ids, SplitFlags(validation=25.0, split_by="prefix"))  # control: the advice taken
    assert not warnings_of(caplog, [f"img{index}" for index in range(10)], SplitFlags(validation=50.0))  # one id each
    # A single group: nothing to choose, though the split cuts through it.
    assert not warnings_of(caplog, [f"car_{index:02d}" for index in range(16)], SplitFlags(validation=50.0))


def test_greedy_choice_with_uneven_groups() -> None:
    assert choose_validation([5, 1, 1, 3], target=2.0) == [1, 2]
    assert choose_validation([10, 10], target=1.0) == [0]  # at least one group
    assert choose_validation([1, 1], target=5.0) == [0]  # never every group
    ids = [f"big_{i}" for i in range(6)] + [f"s{k}_1" for k in range(4)]
    train, validation = split_positions(sorted(ids), SplitFlags(split_by="prefix", validation=40.0))
    assert len(validation) in (4, 6) and sides(sorted(ids), train).isdisjoint(sides(sorted(ids), validation))


@pytest.mark.parametrize("by", ["image", "prefix"])
def test_folds_are_disjoint_and_cover_the_data(by: str) -> None:
    ids = carvana_ids(10, 3)
    folds = [split_positions(ids, SplitFlags(split_by=by, folds=4, fold=k)) for k in range(4)]
    validations = [set(validation) for _, validation in folds]
    assert set().union(*validations) == set(range(30))
    assert sum(len(v) for v in validations) == 30  # disjoint
    for train, validation in folds:
        assert set(train) == set(range(30)) - set(validation)
        if by == "prefix":
            assert sides(ids, train).isdisjoint(sides(ids, validation))
    sizes = sorted(len(v) for v in validations)
    assert sizes[-1] - sizes[0] <= (3 if by == "prefix" else 1)


def test_assign_folds_balances_by_images() -> None:
    assert assign_folds([1, 1, 1, 1], 2) == [0, 1, 0, 1]
    assert assign_folds([4, 1, 1, 1, 1], 2) == [0, 1, 1, 1, 1]


def test_flag_checks_name_the_flag() -> None:
    check_split_flags("prefix", r"^(\w+)-", 5, 4)
    with pytest.raises(ConfigError, match="--fold 5 with --folds 5"):
        check_split_flags("image", None, 5, 5)
    with pytest.raises(ConfigError, match="--folds 1"):
        check_split_flags("image", None, 1, 0)
    with pytest.raises(ConfigError, match="--fold 2 needs --folds"):
        check_split_flags("image", None, 0, 2)
    with pytest.raises(ConfigError, match="add --split-by prefix"):
        check_split_flags("image", "(x)", 0, 0)
    with pytest.raises(ConfigError, match="has no group"):
        check_split_flags("prefix", "abc", 0, 0)
    with pytest.raises(ConfigError, match="not a regular expression"):
        check_split_flags("prefix", "(", 0, 0)


def test_split_file_round_trip_digest_and_evaluate_positions(tmp_path: Path) -> None:
    ids = carvana_ids(6, 2)
    _, _, record = split_dataset(ids, SplitFlags(split_by="prefix", validation=30.0), tmp_path)
    path = tmp_path / "split.json"
    write_run_text(path, record.file_text())
    assert [p.name for p in tmp_path.iterdir()] == ["split.json"]  # no temporary file left
    raw = json.loads(path.read_text())
    assert raw["rule"] == "prefix" and raw["seed"] == 0 and raw["validation"] == list(record.validation)
    loaded = read_split_file(path)
    assert loaded == record and loaded.digest == record.digest
    other = split_dataset(ids, SplitFlags(validation=30.0), tmp_path)[2]
    assert other.digest != record.digest
    check_same_split(record.digest, loaded, "last.pth")
    check_same_split(None, other, "old.pth")  # files from before splits were recorded
    with pytest.raises(ConfigError, match="last.pth was trained on another train/validation split"):
        check_same_split(record.digest, other, "last.pth")
    shuffled = list(reversed(ids)) + ["extra_01"]
    assert scored_ids(shuffled, path) == sorted(record.validation, reverse=True)
    with pytest.raises(DatasetError, match=rf"{len(record.validation)} of the {len(record.validation)} validation "
                       r"images of --split .*split\.json are not in the folders given"):  # fmt: skip
        scored_ids(["x"], path)


def test_unreadable_split_file_names_the_flag(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="--split .*bad.json is not JSON"):
        read_split_file(bad)
    with pytest.raises(ConfigError, match="cannot read it"):
        read_split_file(tmp_path / "missing.json")
    bad.write_bytes(b'{"train": ["caf\xe9"]}')  # latin-1, not UTF-8
    with pytest.raises(ConfigError, match=r"bad\.json is not UTF-8 text \(byte 15\); save it as UTF-8"):
        read_split_file(bad)
    bad.write_bytes(b" " * (MAX_SPLIT_FILE_BYTES + 1))
    with pytest.raises(ConfigError, match=r"--split .*bad\.json is larger than 64 MiB; pass the split\.json"):
        read_split_file(bad)


def _edited_split(tmp_path: Path, **changes: object) -> Path:
    raw = split_dataset(carvana_ids(6, 2), SplitFlags(split_by="prefix", validation=30.0), tmp_path)[2].as_dict()
    path = tmp_path / "split.json"
    path.write_text(json.dumps({**raw, **changes}))
    return path


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"seed": "abc"}, r"seed must be int, got 'abc'"),
        ({"folds": 2.5}, r"folds must be int, got 2\.5"),
        ({"fold": True}, r"fold must be int or null, got True"),
        ({"validation_percent": "30"}, r"validation_percent must be int or float or null"),
        ({"validation": []}, r"lists no validation images"),
        ({"validation": [1, 2]}, r"the train and validation ids must be text"),
        ({"rule": "random"}, r"rule 'random' / folds 0 is not a split this makes"),
    ],
)
def test_split_file_fields_are_typed_and_checked(tmp_path: Path, changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=rf"--split .*split\.json: .*{message}|--split .*split\.json {message}"):
        read_split_file(_edited_split(tmp_path, **changes))


def test_split_file_ids_listed_twice_or_on_both_sides_are_refused(tmp_path: Path) -> None:
    path = _edited_split(tmp_path)
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "validation": raw["validation"] * 3}))
    with pytest.raises(ConfigError, match=r"lists 4 id\(s\) more than once, on one side or both \(.+\)"):
        read_split_file(path)
    path.write_text(json.dumps({**raw, "validation": raw["validation"] + raw["train"][:1]}))
    with pytest.raises(ConfigError, match=rf"lists 1 id\(s\) more than once, .*\({re.escape(raw['train'][0])}\)"):
        read_split_file(path)
    del raw["seed"]
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"seed must be int, got None"):
        read_split_file(path)


def test_a_split_other_than_the_recorded_one_is_refused_unless_asked(tmp_path: Path) -> None:
    path = _edited_split(tmp_path)
    ids = carvana_ids(6, 2)
    record = read_split_file(path)
    validation = sorted(record.validation)
    assert scored_ids(ids, path, trained_on=record.digest) == validation  # the model's own split
    assert scored_ids(ids, path, trained_on=None) == validation  # a checkpoint that records none
    with pytest.raises(ConfigError, match=r"split\.json is not the split m\.pth was trained on.*add --other-split"):
        scored_ids(ids, path, trained_on="0" * 64)
    assert scored_ids(ids, path, trained_on="0" * 64, other_split=True) == validation


def test_group_split_far_above_the_asked_share_warns_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    flags = SplitFlags(split_by="prefix", validation=10.0)
    (line,) = warnings_of(caplog, carvana_ids(2, 8), flags)  # two groups of 8: whole groups cannot come near 10 %
    assert "validates 8 of 16 images (50%) where --validation asked 10%" in line
    # Control: groups small enough to come near the share say nothing.
    assert not warnings_of(caplog, carvana_ids(10, 2), flags)


@pytest.mark.parametrize(
    ("ids", "flags", "message"),
    [
        (
            carvana_ids(1, 4),
            SplitFlags(split_by="prefix"),
            r"--split-by prefix --validation 10 leaves 0 training and 4 "
            r"validation images out of 4: the ids form 1 group\(s\), too few to split: use --split-by image",
        ),
        (
            carvana_ids(3, 2),
            SplitFlags(split_by="prefix", folds=4, fold=1),
            r"--split-by prefix --folds 4 leaves .*: 3 "
            r"groups cannot fill 4 folds \(a fold stays empty\): use --folds 3 or fewer \(or add images to imgs\)",
        ),
        (carvana_ids(1, 1), SplitFlags(folds=2), r"--split-by image --folds 2 leaves .*: too few images to split"),
        (
            carvana_ids(1, 5),
            SplitFlags(validation=10.0),
            r"--validation 10 leaves 5 training and 0 validation images "
            r"out of 5: choose a --validation that leaves at least one of each",
        ),
    ],
)
def test_a_split_that_leaves_a_side_empty_names_the_flag_to_change(ids, flags, message) -> None:
    with pytest.raises(ConfigError, match=message):
        split_dataset(ids, flags, Path("imgs"))
