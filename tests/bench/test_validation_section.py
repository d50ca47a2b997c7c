"""The benchmark's validation section: 2 real gloo processes per measurement, ``--val-mode rank0`` and ``sharded``.

No timing assertions: the figures only have to exist, and to come from runs that really validated in the mode they
are labelled with (rank0: every image on rank 0; sharded: disjoint shards), with the same scores both ways.
"""

from __future__ import annotations

import statistics

import pytest

from scripts.bench.validation import QUICK, validation_percent
from tests.bench.conftest import RunBenchmark
from tests.helpers import positive
from utils.datasets.splits import split_sizes


@pytest.mark.parametrize(("val_images", "train_images"), [(5, 2), (64, 4), (64, 2), (1, 1), (999, 2), (7, 93)])
def test_the_percentage_holds_out_exactly_the_validation_images(val_images: int, train_images: int) -> None:
    total = val_images + train_images
    percent = float(repr(validation_percent(val_images, total)))  # as train.py parses it back
    assert split_sizes(total, percent) == (val_images, train_images)


@pytest.mark.slow
def test_quick_section_times_both_modes_from_runs_that_used_them(run_benchmark: RunBenchmark) -> None:
    # One pair of runs: each is two torchrun processes, and the median and ratio code is the same for one pair or more.
    run = run_benchmark(["--quick", "--sections", "validation", "--repeat", "1"])
    section, stdout = run.doc["validation"], run.stdout

    assert positive(section["rank0_s"]) and positive(section["sharded_s"])
    rank0_runs, sharded_runs = section["runs"]["rank0"], section["runs"]["sharded"]
    assert len(rank0_runs) == len(sharded_runs) == 1
    assert section["rank0_s"] == statistics.median(run["seconds"] for run in rank0_runs)
    assert section["sharded_s"] == statistics.median(run["seconds"] for run in sharded_runs)
    assert section["ratios"] == [r["seconds"] / s["seconds"] for r, s in zip(rank0_runs, sharded_runs, strict=True)]
    assert section["ratio"] == statistics.median(section["ratios"])

    # 5 validation images at 2 processes of 1 thread each (the trainer's threads per process at --threads 1).
    assert (section["val_images"], section["processes"], section["threads_per_process"]) == (QUICK.val_images, 2, 1)
    for run in rank0_runs:
        assert run["mode"] == "rank0" and run["world_size"] == 2 and run["val_images"] == QUICK.val_images
        assert run["images_per_rank"] == [QUICK.val_images, 0], "rank 0 scored the whole set, rank 1 nothing"
    for run in sharded_runs:
        assert run["mode"] == "sharded" and run["world_size"] == 2 and run["val_images"] == QUICK.val_images
        assert run["images_per_rank"] == [3, 2], "each rank scored its own shard, together the whole set once"
    # Every rank of every run ends with the same score: the sharded sums add up to rank 0's whole-set result.
    dice = [d for run in rank0_runs + sharded_runs for d in run["dice_per_rank"]]
    assert 0 < dice[0] and dice == pytest.approx([dice[0]] * len(dice), abs=1e-6)
    assert "\nvalidation " in stdout and "FAILED" not in stdout
