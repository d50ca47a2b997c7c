"""scripts/benchmark.py on tiny settings (every section, real subprocesses), scripts/bench's pure helpers, FLOPs.

No timing assertions: the figures only have to exist and be positive. Speed itself is what the benchmark reports.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from scripts import benchmark
from scripts.bench.context import SECTIONS
from scripts.bench.demo_data import demo_image_count, write_linked_dataset
from scripts.bench.flops import count_flops, matmul_flops, measure_matmul_peak, training_flops_per_image
from scripts.bench.training import median_run, steady_state
from tests.bench.conftest import RunBenchmark
from tests.helpers import positive
from unet import UNet
from utils.training.objective import segmentation_loss


@pytest.mark.slow
def test_quick_run_measures_every_other_section(run_benchmark: RunBenchmark) -> None:
    # The epoch, validation and compile sections start train.py runs of their own: their files test them.
    others = [section for section in SECTIONS if section not in ("epoch", "validation", "compile")]
    run = run_benchmark(["--quick", "--pixel-cache", "both", "--sections", ",".join(others)])
    doc, stdout, tmp_path = run.doc, run.stdout, run.work_dir.parent

    assert doc["schema"] == 1 and doc["machine"]["device"] == "cpu" and positive(doc["machine"]["cpus_available"])
    assert doc["settings"]["size"] == "64x48" and doc["settings"]["precisions"] == ["fp32"]

    compute = doc["compute"]["fp32"]
    for key in ("images_per_s", "flops_per_image", "achieved_flops_per_s", "matmul_peak_flops_per_s"):
        assert positive(compute[key]), key
    assert (
        0
        < compute["fraction_of_peak"]
        == pytest.approx(compute["achieved_flops_per_s"] / compute["matmul_peak_flops_per_s"])
    )

    e2e = doc["e2e"]["fp32"]
    assert positive(e2e["images_per_s"]) and e2e["steps_timed"] >= 1 and e2e["validation_ran"] is False
    assert e2e["ratio_to_compute"] == pytest.approx(e2e["images_per_s"] / compute["images_per_s"])
    assert e2e["ratios_to_compute"] == [e2e["ratio_to_compute"]]
    cached = doc["e2e"]["fp32 pixel-cache"]
    assert cached["pixel_cache"] is True and e2e["pixel_cache"] is False
    assert cached["ratio_to_uncached"] == pytest.approx(cached["images_per_s"] / e2e["images_per_s"])
    assert positive(doc["e2e"]["pixel_cache_build"]["wall_s"])
    assert any((tmp_path / "w" / "pixel-cache").glob("*.npy")), "build-cache filled the e2e runs' cache"

    # Every e2e run trained in the precision its row names, as its own log says.
    assert e2e["run"]["precision"] == "fp32" and e2e["run"]["threads"] == 1 and e2e["run"]["loader_workers"] == 0
    assert len(e2e["interval_images_per_s"]) == e2e["steps_timed"] and all(map(positive, e2e["interval_images_per_s"]))

    ddp = doc["ddp"]
    assert ddp["multi"]["processes"] == 2 and ddp["multi"]["threads_per_process"] >= 1
    assert ddp["ratio"] == pytest.approx(ddp["multi"]["images_per_s"] / ddp["single"]["images_per_s"])

    data = doc["data"]
    assert data["n_masks"] == 24 and positive(data["build_first_s"]) and positive(data["build_second_s"])
    assert set(data["build_first_s_by_processes"]) == {"1", "2"}
    assert all(map(positive, data["build_first_s_by_processes"].values()))
    assert data["item_shape_demo"] == [3, 48, 64]
    for key in ("item_ms_demo", "item_ms_full", "cached_uint8_item_ms_demo", "cached_uint8_item_ms_full"):
        assert positive(data[key]), key
    assert all(positive(v) for v in data["decode"].values()) and len(data["decode"]) == 4
    assert [entry["num_workers"] for entry in data["loader"]] == [0]
    assert positive(data["loader"][0]["images_per_s"]) and positive(data["loader"][0]["ratio_to_model"])
    for key in ("per_worker_items_per_s_uncached", "per_worker_items_per_s_cached", "cache_fill_ms_full"):
        assert positive(data[key]), key
    assert data["per_worker_cached_over_uncached"] == pytest.approx(
        data["per_worker_items_per_s_cached"] / data["per_worker_items_per_s_uncached"]
    )

    (startup,) = doc["startup"]["constructions"]
    assert startup["pairs"] == 200 and positive(startup["first_s"]) and positive(startup["second_s"])
    assert startup["second_us_per_pair"] == pytest.approx(1e6 * startup["second_s"] / 200)

    runs = doc["predict"]["runs"]
    assert [(r["precision"], r["batch_size"]) for r in runs] == [("fp32", 1), ("fp32", 2)]
    assert all(positive(r["images_per_s"]) and r["images"] == 4 for r in runs)

    memory = doc["memory"]["processes"]
    processes = [entry["process"] for entry in memory]
    assert "compute fp32" in processes and any(p.startswith("train.py ddp-2") for p in processes)
    assert all(positive(entry["max_rss_mib"]) for entry in memory)
    checkpointing = doc["memory"]["checkpointing"]
    assert checkpointing["measure"] == "max_rss_mib" and positive(checkpointing["with_mib"])
    assert checkpointing["ratio"] == pytest.approx(checkpointing["with_mib"] / checkpointing["without_mib"])

    for section in ("compute", "e2e", "ddp", "data", "startup", "predict", "memory"):
        assert f"\n{section} " in stdout, section
    assert "FAILED" not in stdout


def test_bad_flags_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert benchmark.main(["--quick", "--batch-size", "3"]) == 2
    assert "--batch-size 3 cannot be split over 2 DDP processes" in capsys.readouterr().err
    assert benchmark.main(["--sections", "compute,gpu"]) == 2
    assert "--sections: unknown gpu" in capsys.readouterr().err
    assert benchmark.main(["--size", "240by160"]) == 2
    assert "--size must look like WIDTHxHEIGHT" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert benchmark.main(["--precisions", "fp32,fp16"]) == 2
        assert "fp16 needs CUDA" in capsys.readouterr().err


def test_steady_state_leaves_out_warmup_steps() -> None:
    # Batch 4; steps 1-2 are slow (start-up), then one step per second.
    times = {1: 100.0, 2: 150.0, 3: 151.0, 4: 152.0, 5: 153.0}
    events = [{"event": "train", "global_step": s, "images_seen": 4 * s, "time": t} for s, t in times.items()]
    events.insert(2, {"event": "val", "global_step": 2, "time": 150.5})
    rate = steady_state(events, warmup_steps=2)
    assert (rate.from_step, rate.to_step, rate.images, rate.seconds) == (2, 5, 12, 3.0)
    assert rate.images_per_s == pytest.approx(4.0)
    # Logged every 2 steps: the window starts at the first logged step after the warm-up.
    every_other = [e for e in events if e["event"] == "train" and e["global_step"] % 2 == 0]
    assert steady_state(every_other + [events[-1]], warmup_steps=1).from_step == 2
    with pytest.raises(ValueError, match="need two logged steps at or after step 5"):
        steady_state(events, warmup_steps=5)


def test_median_run_keeps_every_figure() -> None:
    runs = [{"images_per_s": rate, "name": name} for rate, name in ((3.0, "a"), (1.0, "b"), (2.0, "c"), (4.0, "d"))]
    chosen = median_run(runs)
    assert chosen["name"] == "c" and chosen["images_per_s_runs"] == [3.0, 1.0, 2.0, 4.0]
    assert "images_per_s_runs" not in runs[2]


def test_generated_data_is_reused_only_when_large_enough(tmp_path: Path) -> None:
    folder = write_linked_dataset(tmp_path / "d", 6, (32, 24), distinct=2)
    images = sorted(p.name for p in (folder / "imgs").iterdir())
    assert len(images) == 6 and len(list((folder / "masks").iterdir())) == 6
    # Linked copies are files of their own names with the same content.
    assert (folder / "imgs" / images[0]).read_bytes() == (folder / "imgs" / images[2]).read_bytes()
    assert write_linked_dataset(folder, 4, (32, 24), distinct=2) == folder
    assert len(list((folder / "imgs").iterdir())) == 6
    write_linked_dataset(folder, 9, (32, 24), distinct=2)
    assert len(list((folder / "imgs").iterdir())) == 9 and len(list((folder / "masks").iterdir())) == 9


def test_demo_data_keeps_the_run_inside_the_first_epoch() -> None:
    for steps, batch in ((3, 2), (7, 4), (40, 16)):
        count = demo_image_count(steps, batch)
        n_val = int(count * 0.1)  # train.py's split of --validation 10
        assert count - n_val >= (steps + 1) * batch


def test_flop_counts_have_known_answers() -> None:
    assert matmul_flops(512) == 2 * 512**3
    layer = nn.Linear(8, 4, bias=False)
    assert count_flops(lambda: layer(torch.ones(2, 8))) == 2 * 2 * 8 * 4
    # The figure the issue quotes: a base-64 UNet, forward + backward at 240x160, ~169 GFLOP per image.
    train = training_flops_per_image(
        lambda: UNet(3, 2, base_channels=64), lambda x, y: segmentation_loss(x, y, 2), channels=3, height=160, width=240
    )
    assert train == 169_220_505_600
    # One 1x1 convolution: forward 2*3*2 FLOPs per pixel, backward only the weight gradient (same again), since
    # nobody needs the input's gradient.
    conv = training_flops_per_image(
        lambda: nn.Conv2d(3, 2, 1, bias=False), lambda x, y: segmentation_loss(x, y, 2), channels=3, height=4, width=5
    )
    assert conv == 2 * (2 * 3 * 2 * 4 * 5)


def test_matmul_peak_stops_growing_when_products_get_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    # Products timed as if 512 were the fastest size and 1024 so slow that 2048 (8 x the work) would take too long.
    seconds = {256: 0.002, 512: 0.004, 1024: 0.05, 2048: 0.4}
    timed: list[int] = []

    def fake_time_product(a: torch.Tensor, b: torch.Tensor, device: torch.device, min_seconds: float) -> float:
        timed.append(a.shape[0])
        return seconds[a.shape[0]]

    monkeypatch.setattr("scripts.bench.flops._time_product", fake_time_product)
    peak = measure_matmul_peak("fp32", torch.device("cpu"), max_size=2048, max_seconds_per_product=0.3)
    assert timed == [256, 512, 1024]  # 1024 takes 0.05 s: 2048 would take about 0.4 s, over the 0.3 s allowed
    # The fastest size is kept, not the last one timed.
    assert (peak.size, peak.seconds_per_product) == (512, 0.004)
    assert peak.flops_per_s == matmul_flops(512) / 0.004 and peak.dtype == "fp32"
    timed.clear()
    assert measure_matmul_peak("fp32", torch.device("cpu"), max_size=512).size == 512 and timed == [256, 512]

    monkeypatch.undo()
    # Real products: the rate reported is the work of the size reported over its time.
    real = measure_matmul_peak("fp32", torch.device("cpu"), max_size=512, min_seconds=0.01)
    assert real.flops_per_s == pytest.approx(matmul_flops(real.size) / real.seconds_per_product)
    # A product predicted to take longer than allowed is never started.
    slow = measure_matmul_peak("fp32", torch.device("cpu"), max_size=4096, min_seconds=0.01, max_seconds_per_product=0)
    assert slow.size == 256


def test_gpu_summary_merges_runs_and_test_counts(tmp_path: Path) -> None:
    from scripts.bench import gpu_summary

    (tmp_path / "cuda-tests.xml").write_text(
        '<testsuites><testsuite><testcase name="a"/><testcase name="b"><failure/></testcase>'
        '<testcase name="c"><skipped/></testcase></testsuite></testsuites>'
    )
    machine = {"device": "cuda", "gpu": "GPU X", "cpu": "CPU Y", "torch": "2.x"}
    run = {"complete": False, "machine": machine, "rows": [["e2e", "bf16 train.py", "9 img/s", "a | b"]]}
    (tmp_path / "b16.json").write_text(json.dumps(run))
    assert gpu_summary.main([str(tmp_path), "tests", "b16", "b8"]) == 0
    merged = json.loads((tmp_path / "gpu_check.json").read_text())
    assert merged["tests"] == {"total": 3, "failed": ["b"], "skipped": ["c"], "passed": 1}
    assert merged["runs"]["b8"] == {"missing": True}
    table = (tmp_path / "gpu_check.md").read_text()
    assert "CUDA tests: 1 passed, 1 failed, 1 skipped (failed: b)" in table and "GPU X" in table
    assert "| b16 (cut short) | e2e | bf16 train.py | 9 img/s | a / b |" in table
    assert "| b8 | - | not run or no result | - | - |" in table
