"""The compute and e2e sections: the trainer's own step on batches held in memory, against the real ``train.py``.

Compute-only builds the run exactly as ``train.py`` does (``build_trainer`` from a ``TrainConfig`` parsed by
``train.py``'s own parser, from the very flags the end-to-end run gets) and times ``trainer.step``, the ``TrainStep``
the training loop calls (autocast, the non-finite guard, clipping, the scheduler step), on a few batches taken from
the run's loader before the clock starts. The end-to-end / compute-only ratio therefore compares one step with
itself, with and without the loop around it (data loading, logging, the stop poll).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from scripts.bench.context import BenchConfig, Context, logged_total_steps
from scripts.bench.demo_data import ensure_demo_data
from scripts.bench.processes import REPO_ROOT, MeasurementError, call_worker, run_child, tail
from scripts.bench.report import IMPOSSIBLE_E2E_RATIO, reliability
from scripts.bench.run_log import check_precision
from scripts.bench.timing import cuda_max_allocated_mib, sync, timed
from utils.checkpoint.run_folder import RunFolder

if TYPE_CHECKING:
    from utils.training.loop import Trainer
    from utils.training.step import TrainStep

# Distinct batches the compute-only steps cycle through (the loader's first ones, moved to the device beforehand).
HELD_BATCHES = 4


@dataclass(frozen=True)
class SteadyState:
    """Images/s between two logged steps of a training run, leaving out the steps before ``from_step``."""

    images_per_s: float
    from_step: int
    to_step: int
    images: int
    seconds: float


def steady_state(events: Sequence[dict[str, Any]], warmup_steps: int) -> SteadyState:
    """Steady-state throughput from ``metrics.jsonl`` train events (global images and wall-clock timestamps).

    The window starts at the first logged step at or after ``warmup_steps`` and ends at the last logged step, so
    start-up, the first allocations and compilation are outside it.
    """
    train = sorted((e for e in events if e.get("event") == "train"), key=lambda e: e["global_step"])
    starts = [e for e in train if e["global_step"] >= warmup_steps]
    if len(starts) < 2:
        raise ValueError(
            f"need two logged steps at or after step {warmup_steps}, got steps {[e['global_step'] for e in train]}"
        )
    first, last = starts[0], starts[-1]
    images = int(last["images_seen"] - first["images_seen"])
    seconds = float(last["time"] - first["time"])
    if seconds <= 0 or images <= 0:
        raise ValueError(f"no progress between steps {first['global_step']} and {last['global_step']}")
    return SteadyState(images / seconds, int(first["global_step"]), int(last["global_step"]), images, seconds)


def interval_rates(events: Sequence[dict[str, Any]], warmup_steps: int) -> list[float]:
    """Images/s of each logged interval from step ``warmup_steps`` on: the steady-state window, interval by interval."""
    train = sorted((e for e in events if e.get("event") == "train"), key=lambda e: e["global_step"])
    window = [e for e in train if e["global_step"] >= warmup_steps]
    return [
        (later["images_seen"] - earlier["images_seen"]) / (later["time"] - earlier["time"])
        for earlier, later in zip(window, window[1:], strict=False)
        if later["time"] > earlier["time"]
    ]


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median images/s (the lower middle one of an even count), plus every run's figure."""
    rates = [run["images_per_s"] for run in runs]
    chosen = dict(runs[rates.index(statistics.median_low(rates))])
    chosen["images_per_s_runs"] = rates
    return chosen


def train_argv(
    config: BenchConfig,
    data: Path,
    precision: str,
    *,
    processes: int,
    name: str,
    runs: Path,
    pixel_cache: Path | None = None,
    checkpointing: bool = False,
) -> list[str]:
    """The ``train.py`` flags of a measured run: the end-to-end run gets them, compute-only parses them."""
    args = [
        "--imgs", str(data / "imgs"), "--masks", str(data / "masks"), "--scale", str(config.scale),
        "--batch-size", str(config.batch_size // processes), "--base-channels", str(config.base_channels),
        "--classes", str(config.classes), "--precision", precision, "--epochs", "1",
        "--max-steps", str(logged_total_steps(config)), "--log-every", str(config.log_every),
        "--checkpoint-dir", str(runs), "--exp_name", name, "--seed", "0",
        "--threads", str(max(1, config.threads // processes)), "--device", config.device,
        "--wandb", "disabled", "--validation", "10",
    ]  # fmt: skip
    if config.num_workers is not None:
        args += ["--num-workers", str(config.num_workers)]
    if config.channels_last:
        args.append("--channels-last")
    if config.compile:
        args.append("--compile")
    if pixel_cache is not None:
        args += ["--pixel-cache", str(pixel_cache)]
    if checkpointing:
        args.append("--checkpointing")
    return args


def pixel_cache_folder(ctx: Context) -> Path:
    """The e2e runs' ``--pixel-cache``, filled by ``build-cache`` before the first cached run."""
    return ctx.work_dir / "pixel-cache"


def runs_folder(ctx: Context) -> Path:
    """Where the measured runs keep their run folders."""
    return ctx.work_dir / "runs"


# ---------------------------------------------------------------------------------------------- orchestrator


def run_compute_and_e2e(ctx: Context) -> None:
    """The compute and e2e sections, alternating per precision: compute, train.py, compute, train.py, ...

    Each end-to-end figure is paired with the compute figure taken just before it, and the reported ratio is the
    median of the pairs' ratios: on a machine shared with other work the load drifts over minutes, and a compute run
    taken long before its end-to-end run would make the ratio measure the drift (see docs/PERFORMANCE.md).
    """
    config = ctx.config
    want_compute, want_e2e = "compute" in config.sections, "e2e" in config.sections
    data = ensure_demo_data(ctx)  # compute-only builds the same run as train.py, data set included
    compute_out: dict[str, Any] = {}
    e2e_out: dict[str, Any] = {}
    modes = config.pixel_cache if want_e2e else []
    if "on" in modes:
        e2e_out["pixel_cache_build"] = fill_pixel_cache(ctx, data)
    for precision in config.precisions:
        computes: list[dict[str, Any]] = []
        trains: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
        for repeat in range(config.repeat):
            suffix = f"{precision}" + (f"-{repeat + 1}" if config.repeat > 1 else "")
            if want_compute:
                computes.append(compute_run(ctx, data, precision, name=f"compute-{suffix}"))
            for mode in modes:
                name = f"e2e-{suffix}" + ("-pixel-cache" if mode == "on" else "")
                cache = pixel_cache_folder(ctx) if mode == "on" else None
                trains[mode].append(train_run(ctx, data, precision, processes=1, name=name, pixel_cache=cache))
        if computes:
            compute_out[precision] = median_run(computes)
            peak = compute_out[precision].get("matmul_peak_flops_per_s")
            compute_out[precision]["reliability"] = reliability(
                compute_out[precision]["images_per_s_runs"],
                [computes[0]["load_average"][0], computes[-1]["load_average"][1]],
                "a matmul peak of 0" if peak is not None and peak <= 0 else "",
            )
            ctx.remember_memory(f"compute {precision}", compute_out[precision])
            _compute_row(ctx, precision, compute_out[precision])
        for mode, runs in trains.items():
            key = precision if mode == "off" else f"{precision} pixel-cache"
            e2e_out[key] = result = median_run(runs)
            ratios = [t["images_per_s"] / c["images_per_s"] for c, t in zip(computes, runs, strict=False)]
            result["pixel_cache"] = mode == "on"
            result["ratios_to_compute"] = ratios
            result["ratio_to_compute"] = statistics.median(ratios) if ratios else None
            if mode == "on" and "off" in trains:
                pairs = zip(trains["off"], runs, strict=True)
                result["ratios_to_uncached"] = [on["images_per_s"] / off["images_per_s"] for off, on in pairs]
                result["ratio_to_uncached"] = statistics.median(result["ratios_to_uncached"])
            ratio = result["ratio_to_compute"]
            impossible = ratio is not None and ratio > IMPOSSIBLE_E2E_RATIO
            result["reliability"] = reliability(
                result["images_per_s_runs"],
                [runs[0]["load_average"][0], runs[-1]["load_average"][1]],
                f"end-to-end {ratio:.2f}x compute-only (> {IMPOSSIBLE_E2E_RATIO})" if impossible else "",
            )
            _e2e_row(ctx, key, result)
    if want_compute:
        ctx.results["compute"] = compute_out
    if want_e2e:
        ctx.results["e2e"] = e2e_out


def compute_run(
    ctx: Context,
    data: Path,
    precision: str,
    *,
    name: str,
    checkpointing: bool = False,
    steps: int | None = None,
    peak: bool = True,
) -> dict[str, Any]:
    config = ctx.config
    shutil.rmtree(runs_folder(ctx) / name, ignore_errors=True)
    argv = train_argv(
        config, data, precision, processes=1, name=name, runs=runs_folder(ctx), checkpointing=checkpointing
    )
    spec = {
        "train_argv": argv,
        "steps": config.steps if steps is None else steps,
        "warmup": config.warmup,
        "peak_max_size": config.peak_max_size,
        "peak": peak,
    }
    load_before = os.getloadavg()[0]
    result = call_worker("compute", spec, threads=config.threads, config=config, log_dir=ctx.log_dir)
    result["load_average"] = [load_before, os.getloadavg()[0]]
    return result


def memory_with_checkpointing(ctx: Context) -> dict[str, Any]:
    """Peak memory of the trainer's step with and without ``--checkpointing`` (one timed step each, no peak)."""
    config = ctx.config
    data = ensure_demo_data(ctx)
    precision = config.precisions[0]
    runs = {}
    for checkpointing in (False, True):
        name = f"memory-{precision}" + ("-checkpointing" if checkpointing else "")
        runs[checkpointing] = compute_run(
            ctx, data, precision, name=name, checkpointing=checkpointing, steps=1, peak=False
        )
    plain, checkpointed = runs[False], runs[True]
    key = "cuda_max_allocated_mib" if plain.get("cuda_max_allocated_mib") is not None else "max_rss_mib"
    return {
        "precision": precision,
        "measure": key,
        "without_mib": plain[key],
        "with_mib": checkpointed[key],
        "ratio": checkpointed[key] / plain[key],
        "images_per_s_without": plain["images_per_s"],
        "images_per_s_with": checkpointed["images_per_s"],
    }


def fill_pixel_cache(ctx: Context, data: Path) -> dict[str, Any]:
    """``build-cache`` over the training data, as a user would before a run; its wall time."""
    config = ctx.config
    command = [
        sys.executable, "-m", "utils.datasets.pixel_cache", "build-cache", "--imgs", str(data / "imgs"),
        "--masks", str(data / "masks"), "--scale", str(config.scale), "--cache", str(pixel_cache_folder(ctx)),
        "--workers", str(config.threads),
    ]  # fmt: skip
    run = run_child(command, threads=1, timeout=config.timeout, log_path=ctx.log_dir / "build-cache.log")
    if run.returncode != 0:
        raise MeasurementError(f"build-cache exited with {run.returncode}:\n{tail(run.output)}")
    ctx.row("e2e", "pixel cache build-cache (up front)", f"{run.wall_s:.3g} s", f"{config.threads} process(es)")
    return {"wall_s": run.wall_s, "max_rss_mib": run.max_rss_mib}


def train_run(
    ctx: Context, data: Path, precision: str, *, processes: int, name: str, pixel_cache: Path | None = None
) -> dict[str, Any]:
    """Run train.py (under torchrun when ``processes > 1``) and return its steady-state throughput."""
    config = ctx.config
    threads = max(1, config.threads // processes)
    args = train_argv(
        config, data, precision, processes=processes, name=name, runs=runs_folder(ctx), pixel_cache=pixel_cache
    )
    train_py = str(REPO_ROOT / "train.py")
    if processes > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
        command = [*launcher, train_py, "--ddp_mode", *args]
    else:
        command = [sys.executable, train_py, *args]
    run_dir = runs_folder(ctx) / name
    shutil.rmtree(run_dir, ignore_errors=True)
    load_before = os.getloadavg()[0]
    run = run_child(command, threads=threads, timeout=config.timeout, log_path=ctx.log_dir / f"{name}.log")
    if run.returncode != 0:
        raise MeasurementError(f"{name}: train.py exited with {run.returncode}:\n{tail(run.output)}")
    # The row names a precision: the run's own "Starting training" line must say it trained in it.
    summary = check_precision(run.output, precision, name)
    events = [json.loads(line) for line in RunFolder(run_dir).metrics.read_text().splitlines() if line.strip()]
    rate = steady_state(events, config.warmup)
    result = {
        "precision": precision,
        "run": summary,
        "processes": processes,
        "threads_per_process": threads,
        "images_per_s": rate.images_per_s,
        "steps_timed": rate.to_step - rate.from_step,
        "seconds_timed": rate.seconds,
        # The spread of the logged intervals inside the window, and the machine's load around the run: a wide
        # spread with a load above the run's own threads is other work taking the cores, not the loop.
        "interval_images_per_s": interval_rates(events, config.warmup),
        "load_average": [load_before, os.getloadavg()[0]],
        "validation_ran": any(e.get("event") == "val" for e in events),
        "wall_s": run.wall_s,
        "max_rss_mib": run.max_rss_mib,
    }
    ctx.remember_memory(f"train.py {name}" + (f" (largest of {processes} ranks)" if processes > 1 else ""), result)
    return result


def _spread(result: dict[str, Any]) -> str:
    rates = result["images_per_s_runs"]
    return f" ({min(rates):.3g}-{max(rates):.3g}, {len(rates)} runs)" if len(rates) > 1 else ""


def _compute_row(ctx: Context, precision: str, result: dict[str, Any]) -> None:
    ctx.row(
        "compute",
        f"{precision} forward+backward+step",
        f"{result['images_per_s']:.3g} img/s{_spread(result)}{result['reliability']['mark']}",
        f"{result['flops_per_image'] / 1e9:.1f} GFLOP/img; {result['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s = "
        f"{100 * result['fraction_of_peak']:.0f}% of {precision} matmul peak "
        f"{result['matmul_peak_flops_per_s'] / 1e9:.1f} GFLOP/s",
    )


def _e2e_row(ctx: Context, precision: str, result: dict[str, Any]) -> None:
    ratios = result["ratios_to_compute"]
    if not ratios:
        note = "(run the compute section too for the ratio)"
    elif len(ratios) == 1:
        note = f"{ratios[0]:.2f} of compute-only"
    else:
        note = f"{result['ratio_to_compute']:.2f} of compute-only (median of {len(ratios)} paired runs: "
        note += ", ".join(f"{r:.2f}" for r in ratios) + ")"
    if result.get("ratio_to_uncached") is not None:
        note += f"; {result['ratio_to_uncached']:.2f} of the uncached run's images/s"
    intervals = result.get("interval_images_per_s") or []
    if len(intervals) > 1:
        load = result["load_average"]
        note += (
            f"; trained in {result['run']['precision']} with {result['run']['threads']} threads, "
            f"{result['run']['loader_workers']} loader workers; steps {min(intervals):.3g}-{max(intervals):.3g} "
            f"img/s, load {load[0]:.1f}-{load[1]:.1f}"
        )
    if result["validation_ran"]:
        note += "; validation ran inside the window (too few images in --data-dir)"
    label = precision.replace(" pixel-cache", " train.py steady state, --pixel-cache")
    if label == precision:
        label = f"{precision} train.py steady state"
    ctx.row("e2e", label, f"{result['images_per_s']:.3g} img/s{_spread(result)}{result['reliability']['mark']}", note)


# ------------------------------------------------------------------------------------------------- worker


@contextlib.contextmanager
def built_trainer(argv: list[str]) -> Iterator[Trainer]:
    """The trainer ``train.py`` builds from ``argv``, closed and torn down on exit.

    The same wiring as train.py's main(), without the signal handlers: the benchmark never runs the loop.
    """
    from utils.launch.environments import plan_launch
    from utils.launch.process_group import teardown
    from utils.launch.signals import InterruptFlag
    from utils.training.config import parse_config
    from utils.training.setup import build_trainer, join

    config = parse_config(argv)
    ctx = join(config, plan_launch(config.launch, argv=argv))
    try:
        trainer = build_trainer(config, ctx, InterruptFlag())
        try:
            yield trainer
        finally:
            trainer.close()
    finally:
        teardown(ctx)


def compute_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """``train.py``'s set-up from ``spec["train_argv"]``, then its ``TrainStep`` timed on batches held in memory."""
    with built_trainer(spec["train_argv"]) as trainer:
        return _time_train_step(trainer.step, trainer.parts.loaders.train, trainer.parts.model_args, spec)


def _time_train_step(step: TrainStep, loader: Any, model_args: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """Images/s of ``step`` over the loader's first batches, its FLOPs and the matmul peak of its precision."""
    from scripts.bench.flops import measure_matmul_peak, training_flops_per_image
    from unet import build_model
    from utils.training.objective import segmentation_loss

    device, precision, n_classes = step.device, step.precision, step.config.model.classes
    batches = _held_batches(loader, device, channels_last=step.config.performance.channels_last)
    batch_size, _, height, width = batches[0]["image"].shape

    def loss_fn(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        return segmentation_loss(logits, masks, n_classes)

    flops = training_flops_per_image(
        lambda: build_model(model_args), loss_fn, channels=model_args["n_channels"], height=height, width=width
    )
    want_peak = spec.get("peak", True)
    peaks = [measure_matmul_peak(precision, device, max_size=spec["peak_max_size"] or None)] if want_peak else []

    step.raw_model.train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    warmup, steps = spec["warmup"], spec["steps"]
    warmup_times = [timed(lambda i=i: step([batches[i % len(batches)]]), device) for i in range(warmup)]
    # No synchronisation between timed steps (train.py has none either): on a GPU the per-step figures are then
    # launch times, and only the total, synchronised at both ends, counts.
    step_times = []
    sync(device)
    started = time.perf_counter()
    for index in range(warmup, warmup + steps):
        step_started = time.perf_counter()
        step([batches[index % len(batches)]])
        step_times.append(time.perf_counter() - step_started)
    sync(device)
    total = time.perf_counter() - started
    step.take_losses()
    images_per_s = batch_size * steps / total
    # Measured again after the steps, the best of the two kept: a peak taken while other work briefly held the
    # device would make the steps look faster than the peak.
    if want_peak:
        peaks.append(measure_matmul_peak(precision, device, max_size=spec["peak_max_size"] or None))
    peak = max(peaks, key=lambda p: p.flops_per_s) if peaks else None
    peak_flops = peak.flops_per_s if peak is not None else None
    return {
        "precision": precision,
        "images_per_s": images_per_s,
        "step_s_median": statistics.median(step_times),
        "first_step_s": warmup_times[0],
        "batches_held": len(batches),
        "flops_per_image": flops,
        "achieved_flops_per_s": flops * images_per_s,
        "matmul_peak_flops_per_s": peak_flops,
        "matmul_peak_size": peak.size if peak is not None else None,
        "fraction_of_peak": flops * images_per_s / peak_flops if peak_flops else None,
        "cuda_max_allocated_mib": cuda_max_allocated_mib(device),
    }


def _held_batches(loader: Any, device: torch.device, *, channels_last: bool) -> list[dict[str, torch.Tensor]]:
    """The loader's first batches, on the device in the step's memory format, so that the step's copy is a no-op."""
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    held = []
    for batch in loader:
        held.append(
            {
                "image": batch["image"].to(device, memory_format=memory_format),
                "mask": batch["mask"].to(device),
            }
        )
        if len(held) == HELD_BATCHES:
            break
    if not held:
        raise MeasurementError("the training loader gave no batch; use a larger data set or a smaller --batch-size")
    return held
