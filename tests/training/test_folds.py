"""Group-aware splits, k folds and the split on record, through real train.py runs on several views per car."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

import evaluate
from tests.conftest import SyntheticData, TrainRunner, finish, load_checkpoint, torchrun_prefix
from tests.helpers import one_error_line
from utils.checkpoint.format import KEY_SPLIT_DIGEST
from utils.datasets.splits import prefix_of, read_split_file
from utils.datasets.synthetic import generate_carvana_like

CARS, VIEWS = 8, 3


@pytest.fixture(scope="module")
def views_data(tmp_path_factory: pytest.TempPathFactory) -> SyntheticData:
    """8 cars x 3 views, 48x32, Carvana's names (``<car>_01`` .. ``<car>_03``)."""
    root = tmp_path_factory.mktemp("views")
    generate_carvana_like(root, CARS * VIEWS, size=(48, 32), seed=5, views=VIEWS)
    return SyntheticData(root / "imgs", root / "masks", CARS * VIEWS)


@pytest.fixture
def views_runner(views_data: SyntheticData, tmp_path: Path) -> TrainRunner:
    return TrainRunner(views_data, tmp_path / "checkpoints")


def cars(ids: list[str] | tuple[str, ...]) -> set[str]:
    return {prefix_of(image_id) for image_id in ids}


def test_prefix_split_on_record_in_the_folder_and_the_checkpoint(views_runner: TrainRunner) -> None:
    assert views_runner.main("prefix", "--epochs", "1", "--split-by", "prefix", "-v", "25") == 0
    run_dir = views_runner.run_dir("prefix")
    record = read_split_file(run_dir / "split.json")
    assert record.rule == "prefix" and record.seed == 0 and record.validation_percent == 25.0
    assert len(record.validation) == 6 and len(record.train) == 18  # two whole cars validate
    assert cars(record.train).isdisjoint(cars(record.validation))
    assert sorted(record.train + record.validation) == sorted(p.stem for p in views_runner.data.imgs.iterdir())
    assert load_checkpoint(run_dir / "last.pth")[KEY_SPLIT_DIGEST] == record.digest
    assert [p.name for p in run_dir.iterdir() if p.name.startswith(".split")] == []  # no temporary file left


def test_default_split_warns_on_grouped_ids(views_runner: TrainRunner, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert views_runner.main("image", "--epochs", "1", "--max-steps", "1", "-v", "25") == 0
    warnings = [r.getMessage() for r in caplog.records if "look grouped" in r.getMessage()]
    assert len(warnings) == 1 and "use --split-by prefix" in warnings[0]
    record = read_split_file(views_runner.run_dir("image") / "split.json")
    spanning = len(cars(record.train) & cars(record.validation))
    assert spanning > 0 and f"puts {spanning} of those groups on both sides" in warnings[0]


def test_no_warning_with_prefix_or_ungrouped_ids(runner: TrainRunner, caplog: pytest.LogCaptureFixture) -> None:
    # The session's data: 16 views of one car, a single group: nothing a group split could do differently.
    with caplog.at_level(logging.WARNING):
        assert runner.main("one-car", "--epochs", "1", "--max-steps", "1") == 0
    assert not [r for r in caplog.records if "look grouped" in r.getMessage()]


@pytest.mark.slow
def test_folds_have_their_own_folders_and_cover_the_data(views_runner: TrainRunner) -> None:
    validations = []
    for fold in range(3):
        code = views_runner.main("cv", "--epochs", "1", "--max-steps", "1", "--split-by", "prefix", "--folds", "3",
                                 "--fold", str(fold))  # fmt: skip
        assert code == 0
        record = read_split_file(views_runner.checkpoint_dir / f"cv-fold{fold}" / "split.json")
        assert (record.folds, record.fold, record.validation_percent) == (3, fold, None)
        assert cars(record.train).isdisjoint(cars(record.validation))
        validations.append(set(record.validation))
    assert sorted(p.name for p in views_runner.checkpoint_dir.iterdir()) == ["cv-fold0", "cv-fold1", "cv-fold2"]
    assert sum(len(v) for v in validations) == CARS * VIEWS and len(set().union(*validations)) == CARS * VIEWS


def test_resume_refuses_another_split(views_runner: TrainRunner, capsys: pytest.CaptureFixture[str]) -> None:
    assert views_runner.main("a", "--epochs", "2", "--max-steps", "1", "--split-by", "prefix") == 0
    last = views_runner.run_dir("a") / "last.pth"
    assert views_runner.main("a", "--epochs", "2", "--resume", str(last)) == 2
    # The split's flags are refused first (resume rules), naming the flag; the split's digest backs them up.
    assert "--split-by prefix but this run asks for --split-by image" in capsys.readouterr().err
    # Control: the same split flags resume.
    assert views_runner.main("a", "--epochs", "2", "--resume", str(last), "--split-by", "prefix") == 0


def test_evaluate_split_scores_exactly_the_validation_images(views_runner: TrainRunner, tmp_path: Path) -> None:
    assert views_runner.main("ev", "--epochs", "1", "--split-by", "prefix", "-v", "25") == 0
    run_dir = views_runner.run_dir("ev")
    record = read_split_file(run_dir / "split.json")
    common = ["-m", str(run_dir / "last.pth"), "-s", "1", "-j", "0", "--no-progress"]
    data = views_runner.data
    with_split = tmp_path / "with_split.json"
    assert evaluate.main([*common, "--imgs", str(data.imgs), "--masks", str(data.masks), "--split",
                          str(run_dir / "split.json"), "--json", str(with_split)]) == 0  # fmt: skip
    # Control: the validation images copied into folders of their own, scored without --split.
    imgs, masks = tmp_path / "val_imgs", tmp_path / "val_masks"
    imgs.mkdir(), masks.mkdir()
    for image_id in record.validation:
        shutil.copy(data.imgs / f"{image_id}.jpg", imgs)
        shutil.copy(data.masks / f"{image_id}_mask.gif", masks)
    copied = tmp_path / "copied.json"
    assert evaluate.main([*common, "--imgs", str(imgs), "--masks", str(masks), "--json", str(copied)]) == 0
    scored, control = json.loads(with_split.read_text()), json.loads(copied.read_text())
    assert scored["n_images"] == len(record.validation) == control["n_images"] < data.n_images
    assert scored["split"] == str(run_dir / "split.json")
    assert scored["per_class_dice"] == control["per_class_dice"] and scored["reductions"] == control["reductions"]


@pytest.mark.slow
def test_two_ranks_make_one_split_and_rank_0_records_it(views_runner: TrainRunner, tmp_path: Path) -> None:
    """torchrun with two CPU ranks: the fold's split is computed on each rank, written once, and its digest saved."""
    process = views_runner.popen(torchrun_prefix(2), "ddp", "--ddp_mode", "--epochs", "1", "--max-steps", "2",
                                 "--split-by", "prefix", "--folds", "2", "--fold", "1")  # fmt: skip
    out, err = finish(process)
    assert process.returncode == 0, err
    run_dir = views_runner.checkpoint_dir / "ddp-fold1"
    record = read_split_file(run_dir / "split.json")
    assert (record.folds, record.fold) == (2, 1) and cars(record.train).isdisjoint(cars(record.validation))
    assert load_checkpoint(run_dir / "last.pth")[KEY_SPLIT_DIGEST] == record.digest
    assert sorted(p.name for p in views_runner.checkpoint_dir.iterdir()) == ["ddp-fold1"]


def test_evaluate_refuses_a_split_the_model_was_not_trained_on(
    views_runner: TrainRunner, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert views_runner.main("own", "--epochs", "1", "--split-by", "prefix", "-v", "25") == 0
    run_dir, data = views_runner.run_dir("own"), views_runner.data
    raw = json.loads((run_dir / "split.json").read_text())
    swapped = tmp_path / "swapped.json"  # validates the model's training images
    swapped.write_text(json.dumps({**raw, "train": raw["validation"], "validation": raw["train"]}))
    tripled = tmp_path / "tripled.json"  # each id three times: would score every image three times
    tripled.write_text(json.dumps({**raw, "validation": raw["validation"] * 3}))
    capsys.readouterr()

    def scored(model: str, split: Path, *extra: str) -> int:
        return evaluate.main(["-m", str(run_dir / model), "-s", "1", "-j", "0", "--no-progress", "--imgs",
                              str(data.imgs), "--masks", str(data.masks), "--split", str(split), *extra])  # fmt: skip

    for model in ("last.pth", "best.pth"):  # best.pth, the file to share, records the split too
        assert scored(model, swapped) == 2
        line = one_error_line(capsys.readouterr().err)
        assert f"swapped.json is not the split {run_dir / model} was trained on" in line and "--other-split" in line
    assert scored("last.pth", swapped, "--other-split") == 0  # asked for: scored
    assert f"on {len(raw['train'])} images" in capsys.readouterr().out
    assert scored("last.pth", tripled, "--other-split") == 2
    assert "lists 6 id(s) more than once" in one_error_line(capsys.readouterr().err)
    for field, value, message in [("seed", "abc", "seed must be int, got 'abc'"),
                                  ("validation", [], "lists no validation images")]:  # fmt: skip
        edited = tmp_path / f"{field}.json"  # were a traceback and an IndexError
        edited.write_text(json.dumps({**raw, field: value}))
        assert scored("last.pth", edited, "--other-split") == 2
        line = one_error_line(capsys.readouterr().err)
        assert f"--split {edited}" in line and message in line, line
    assert scored("last.pth", run_dir / "split.json") == 0  # control: its own split


def test_more_folds_than_images_names_the_number_that_fits(runner: TrainRunner, capsys) -> None:
    for fold in (
        "0",
        "16",
    ):  # the empty fold and one that is not: both runs belong to a cross-validation that cannot be
        assert runner.main("f17", "--epochs", "1", "--folds", "17", "--fold", fold) == 2
        line = one_error_line(capsys.readouterr().err)
        assert "16 images cannot fill 17 folds (a fold stays empty): use --folds 16 or fewer" in line, line


def test_a_group_split_far_above_the_asked_share_warns(runner: TrainRunner, caplog) -> None:
    # Views 01-09 and 10-16 of the one car as two groups: whole groups put about half in validation, not 10 %.
    with caplog.at_level(logging.WARNING):
        code = runner.main("share", "--epochs", "1", "--max-steps", "1", "--split-by", "prefix",
                           "--group-pattern", r"_(\d)\d$", "-v", "10")  # fmt: skip
    assert code == 0
    warnings = [r.getMessage() for r in caplog.records if "where --validation asked 10%" in r.getMessage()]
    assert len(warnings) == 1 and "--group-pattern with smaller groups" in warnings[0]
