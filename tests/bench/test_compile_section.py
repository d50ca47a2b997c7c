"""The compile section's figures from hand-made metrics records, the reliability marks, and one real quick run."""

from __future__ import annotations

import statistics

import pytest

from scripts.bench.compile import VALIDATION_PERCENT, image_count, run_figures
from scripts.bench.report import reliability
from tests.bench.conftest import RunBenchmark
from tests.helpers import positive
from utils.datasets.splits import split_sizes


def train(epoch: int, step: int, images: int, time: float) -> dict:
    return {"event": "train", "epoch": epoch, "global_step": step, "images_seen": images, "time": time}


def test_first_step_steady_state_and_epoch_time_come_from_this_runs_records() -> None:
    events = [
        {"event": "phase", "phase": "loop_start", "seconds": 0.0, "time": 100.0},
        train(1, 1, 4, 160.0),  # 60 s: the compile
        train(1, 2, 6, 190.0),  # the smaller last batch compiles again
        {"event": "val", "epoch": 1, "time": 195.0},
        train(2, 3, 10, 197.0),
        train(2, 4, 12, 198.0),  # 2 images in 1 s after the epoch's first step
        {"event": "val", "epoch": 2, "time": 200.0},
    ]
    figures = run_figures(events)
    assert figures == pytest.approx({"first_step_s": 60.0, "steady_images_per_s": 2.0, "epoch_s": 5.0})
    assert run_figures(events[:3]) == {"first_step_s": 60.0}  # one epoch: no second-epoch figures


@pytest.mark.parametrize("batch_size", [1, 2, 3, 4, 8])
def test_the_data_ends_each_epoch_with_a_smaller_batch_or_with_full_ones_only_for_quick(batch_size: int) -> None:
    for steps in (1, 3, 7):
        for full_batches in (True, False):
            n_val, n_train = split_sizes(image_count(batch_size, steps, full_batches=full_batches), VALIDATION_PERCENT)
            assert n_val >= 1 and n_train >= batch_size * steps
            if batch_size > 1:  # with a batch of 1 every batch is full
                assert (n_train % batch_size == 0) == full_batches, (steps, full_batches, n_train)


def test_a_spread_over_a_fifth_or_an_impossible_figure_is_marked_unreliable() -> None:
    steady = reliability([10.0, 10.5, 11.0], [0.5, 0.7])
    assert steady["reliable"] and steady["mark"] == "" and steady["spread"] == pytest.approx(0.1 / 1.05, rel=1e-3)
    noisy = reliability([10.0, 13.0], [3.9, 4.2])
    assert not noisy["reliable"] and "spread" in noisy["mark"] and noisy["load_average"] == [3.9, 4.2]
    once = reliability([10.0], [0.1, 0.1], "end-to-end 8.06x compute-only (> 1.2)")
    assert once["spread"] is None and not once["reliable"] and "8.06x compute-only" in once["mark"]


@pytest.mark.slow
def test_quick_compile_section_pairs_eager_and_compiled_runs(run_benchmark: RunBenchmark) -> None:
    run = run_benchmark(["--quick", "--sections", "compile"])
    fp32 = run.doc["compile"]["fp32"]
    pair = fp32["runs"][0]
    for figure in ("first_step_s", "steady_images_per_s", "epoch_s"):
        assert positive(pair["eager"][figure]) and positive(pair["compiled"][figure]), figure
    assert positive(pair["resumed"]["first_step_s"])  # the warm-cache compile of the resumed run
    assert positive(fp32["speedup"]["median"]) and "reliable" in fp32["speedup"]
    # The eager channels_last run: the layout inductor gives the convolutions, without compile.
    assert positive(pair["eager_channels_last"]["steady_images_per_s"])
    steady = "steady_images_per_s"
    ratios = [each["compiled"][steady] / each["eager_channels_last"][steady] for each in fp32["runs"]]
    assert fp32["speedup_over_channels_last"]["median"] == pytest.approx(statistics.median(ratios))
    assert "fp32 steady state, eager channels_last / eager; compiled / eager channels_last" in run.stdout
    assert len(run.doc["compile"]["section_load_average"]) == 2
    assert "fp32 steady state, compiled / eager" in run.stdout and "\ncompile " in run.stdout
    assert (run.work_dir / "runs" / "compile-on-fp32" / "compile-cache").is_dir()
