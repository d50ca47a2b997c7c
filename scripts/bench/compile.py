"""The compile section: ``train.py`` eager against ``train.py --compile`` in one paired run, per precision.

Each pair is two fresh two-epoch runs on the same demo data (the epoch ends with a smaller batch, except with
``--quick``, and validates), then
a one-epoch compiled run in a fresh run folder holding a copy of the compiled run's ``compile-cache/`` (what a resumed
or requeued run finds in its own folder, ``utils.training.compiled``; the resume path itself is tested in
``tests/training/test_compile.py``). From each run's ``metrics.jsonl`` (``--log-every 1``):

* first step: launch of the loop (``loop_start``) to the end of the first step; for the compiled runs, the compile
  time (cold: an empty cache; warm: the resumed run, from the run folder's cache);
* steady state: images/s over the second epoch's steps (every shape compiled by then);
* second epoch: the first epoch's validation record to the second's (the epoch-1 checkpoint, the second epoch's steps
  with their last, smaller batch, its validation): what a compiled epoch costs once compiled.

``--repeat`` alternates the pairs; figures are the medians, and a figure whose repeats spread more than
``report.UNRELIABLE_SPREAD`` is marked unreliable and the precision measured one pair more.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import sys
from typing import Any

from scripts.bench.context import Context
from scripts.bench.demo_data import write_linked_dataset
from scripts.bench.processes import REPO_ROOT, MeasurementError, run_child, tail
from scripts.bench.report import reliability
from scripts.bench.run_log import check_precision
from utils.checkpoint.run_folder import RunFolder
from utils.datasets.splits import split_sizes

SECTION = "compile"
VALIDATION_PERCENT = 10
DISTINCT_SCENES = 8


def run_compile(ctx: Context) -> dict[str, Any]:
    """Eager, compiled (cold cache) and compiled-resumed (warm cache) ``train.py`` runs, per precision."""
    config = ctx.config
    images = image_count(config.batch_size, config.warmup + config.steps, full_batches=config.quick)
    file_size = (round(config.size[0] / config.scale), round(config.size[1] / config.scale))
    data = write_linked_dataset(
        ctx.work_dir / f"compile-data-{images}-{file_size[0]}x{file_size[1]}",
        images,
        file_size,
        distinct=min(DISTINCT_SCENES, images),
    )
    result: dict[str, Any] = {}
    for precision in [p for p in config.precisions if config.device == "cuda" or p != "fp16"]:
        load_before = os.getloadavg()[0]
        pairs = [_pair(ctx, data, precision) for _ in range(config.repeat)]
        result[precision] = _summary(pairs, [load_before, os.getloadavg()[0]])
        if not all(figure.get("reliable", True) for figure in result[precision].values() if isinstance(figure, dict)):
            pairs.append(_pair(ctx, data, precision))  # measured once more; the marks stay if it did not settle
            result[precision] = _summary(pairs, [load_before, os.getloadavg()[0]])
        _rows(ctx, precision, result[precision])
    return result


def image_count(batch_size: int, steps: int, *, full_batches: bool) -> int:
    """Images for ``steps`` batches in each epoch and at least one validation image (train.py refuses a split without).

    The epoch ends with a smaller batch, whose shape compiles once more in the first epoch, unless ``full_batches``
    (``--quick``): then every batch is full and one batch size compiles, which halves the quick run's compile time;
    that a smaller batch compiles once and only in the first epoch is proven in ``tests/training/test_compile.py``.
    """
    images = max(math.ceil(100 / VALIDATION_PERCENT), math.ceil(batch_size * steps / (1 - VALIDATION_PERCENT / 100)))
    # The split's rounding can make the last batch full (or not): add images until it is what was asked for.
    while batch_size > 1 and (split_sizes(images, VALIDATION_PERCENT)[1] % batch_size == 0) != full_batches:
        images += 1
    return images


def _pair(ctx: Context, data: Any, precision: str) -> dict[str, dict[str, Any]]:
    eager = _train(ctx, data, precision, f"compile-eager-{precision}", ["-e", "2"], fresh=True)
    runs: dict[str, dict[str, Any]] = {"eager": eager}
    if not ctx.config.channels_last:
        # On a CPU, inductor runs the convolutions channels_last: the eager step in that layout is what compile
        # must beat (docs/PERFORMANCE.md, "Why compile loses here").
        runs["eager_channels_last"] = _train(
            ctx, data, precision, f"compile-eager-cl-{precision}", ["-e", "2", "--channels-last"], fresh=True
        )
    cold = _train(ctx, data, precision, f"compile-on-{precision}", ["-e", "2", "--compile"], fresh=True)
    # A fresh run folder holding the cold run's compile-cache/, as a resumed or requeued run finds its own.
    warm_name = f"compile-warm-{precision}"
    shutil.rmtree(ctx.work_dir / "runs" / warm_name, ignore_errors=True)
    shutil.copytree(RunFolder(ctx.work_dir / "runs" / cold["name"]).compile_cache,
                    RunFolder(ctx.work_dir / "runs" / warm_name).compile_cache)  # fmt: skip
    warm = _train(ctx, data, precision, warm_name, ["-e", "1", "--compile"], fresh=False)
    return {**runs, "compiled": cold, "resumed": warm}


def _train(ctx: Context, data: Any, precision: str, name: str, extra: list[str], *, fresh: bool) -> dict[str, Any]:
    """One ``train.py`` run; its first-step time, second-epoch steady state and second-epoch time."""
    config = ctx.config
    runs = ctx.work_dir / "runs"
    run_dir = runs / name
    if fresh:
        shutil.rmtree(run_dir, ignore_errors=True)
    argv = [
        "--imgs", str(data / "imgs"), "--masks", str(data / "masks"), "--scale", str(config.scale),
        "-b", str(config.batch_size), "--base-channels", str(config.base_channels), "--classes", str(config.classes),
        "--precision", precision, "--log-every", "1", "-v", str(VALIDATION_PERCENT), "--checkpoint-dir", str(runs),
        "--exp_name", name, "--seed", "0", "--threads", str(config.threads), "--device", config.device,
        "--wandb", "disabled", *extra,
    ]  # fmt: skip
    if config.channels_last:
        argv.append("--channels-last")
    log = ctx.log_dir / f"{name}.log"
    run = run_child([sys.executable, str(REPO_ROOT / "train.py"), *argv], threads=config.threads,
                    timeout=config.timeout, log_path=log)  # fmt: skip
    if run.returncode != 0:
        raise MeasurementError(f"{name}: train.py exited with {run.returncode}:\n{tail(run.output)}")
    check_precision(run.output, precision, name)
    events = [json.loads(line) for line in RunFolder(run_dir).metrics.read_text().splitlines() if line.strip()]
    starts = [i for i, e in enumerate(events) if e.get("event") == "phase" and e["phase"] == "loop_start"]
    if not starts:
        raise MeasurementError(f"{name}: metrics.jsonl has no loop_start record")
    events = events[starts[-1] :]  # this run's records (a resumed run appends to the first one's)
    figures = run_figures(events)
    figures["name"] = name
    figures["wall_s"] = run.wall_s
    figures["max_rss_mib"] = run.max_rss_mib
    ctx.remember_memory(f"train.py {name}", figures)
    return figures


def run_figures(events: list[dict[str, Any]]) -> dict[str, Any]:
    """First-step seconds, and (where the run has two epochs) the last epoch's steady images/s and its time."""
    train = [e for e in events if e.get("event") == "train"]
    if not train:
        raise MeasurementError("metrics.jsonl has no train record after loop_start")
    figures: dict[str, Any] = {"first_step_s": train[0]["time"] - events[0]["time"]}
    last_epoch = train[-1]["epoch"]
    steps = [e for e in train if e["epoch"] == last_epoch]
    if last_epoch > train[0]["epoch"] and len(steps) >= 2:  # the compiling epoch is not a steady state
        figures["steady_images_per_s"] = (steps[-1]["images_seen"] - steps[0]["images_seen"]) / (
            steps[-1]["time"] - steps[0]["time"]
        )
    validations = {e["epoch"]: e["time"] for e in events if e.get("event") == "val"}
    if last_epoch in validations and last_epoch - 1 in validations:
        figures["epoch_s"] = validations[last_epoch] - validations[last_epoch - 1]
    return figures


def _summary(pairs: list[dict[str, dict[str, Any]]], load_average: list[float]) -> dict[str, Any]:
    def values(run: str, key: str) -> list[float]:
        return [pair[run][key] for pair in pairs if key in pair.get(run, {})]

    figures: dict[str, Any] = {"runs": pairs, "load_average": load_average}
    for run, key in (
        ("eager", "first_step_s"),
        ("compiled", "first_step_s"),
        ("resumed", "first_step_s"),
        ("eager", "steady_images_per_s"),
        ("eager_channels_last", "steady_images_per_s"),
        ("compiled", "steady_images_per_s"),
        ("eager", "epoch_s"),
        ("compiled", "epoch_s"),
    ):
        repeats = values(run, key)
        if repeats:
            figures[f"{run}_{key}"] = {"median": statistics.median(repeats), **reliability(repeats, load_average)}
    ratios_of = {"speedup": ("compiled", "eager"), "channels_last_speedup": ("eager_channels_last", "eager"),
                 "speedup_over_channels_last": ("compiled", "eager_channels_last")}  # fmt: skip
    for name, (run, over) in ratios_of.items():
        ratios = [
            pair[run]["steady_images_per_s"] / pair[over]["steady_images_per_s"]
            for pair in pairs
            if "steady_images_per_s" in pair.get(run, {}) and "steady_images_per_s" in pair.get(over, {})
        ]
        if ratios:
            figures[name] = {"median": statistics.median(ratios), **reliability(ratios, load_average)}
    warm = values("resumed", "first_step_s")
    cold = values("compiled", "first_step_s")
    if warm and cold:
        ratios = [w / c for w, c in zip(warm, cold, strict=True)]
        figures["warm_over_cold"] = {"median": statistics.median(ratios), **reliability(ratios, load_average)}
    return figures


def _rows(ctx: Context, precision: str, result: dict[str, Any]) -> None:
    def cell(key: str, unit: str) -> str:
        figure = result.get(key)
        if figure is None:
            return "-"
        return f"{figure['median']:.3g}{unit}{figure['mark']}"

    load = result["load_average"]
    note = f"load {load[0]:.1f} -> {load[1]:.1f}"
    ctx.row(
        SECTION,
        f"{precision} steady state, compiled / eager (2nd epoch)",
        cell("speedup", "x"),
        f"{cell('compiled_steady_images_per_s', ' img/s')} / {cell('eager_steady_images_per_s', ' img/s')}; {note}",
    )
    if "channels_last_speedup" in result:
        ctx.row(
            SECTION,
            f"{precision} steady state, eager channels_last / eager; compiled / eager channels_last",
            f"{cell('channels_last_speedup', 'x')}; {cell('speedup_over_channels_last', 'x')}",
            f"{cell('eager_channels_last_steady_images_per_s', ' img/s')} eager channels_last; {note}",
        )
    ctx.row(
        SECTION,
        f"{precision} first step: compiled cold / warm cache / eager",
        f"{cell('compiled_first_step_s', ' s')} / {cell('resumed_first_step_s', ' s')} / "
        f"{cell('eager_first_step_s', ' s')}",
        f"warm / cold {cell('warm_over_cold', '')}; warm: a run folder holding the compiled run's compile-cache/",
    )
    ctx.row(
        SECTION,
        f"{precision} second epoch (last smaller batch, validation), compiled / eager",
        f"{cell('compiled_epoch_s', ' s')} / {cell('eager_epoch_s', ' s')}",
        note,
    )
