"""The epoch section: one whole ``train.py`` epoch (steps, validation, checkpoints), its wall time split, and its ratio
to the compute bound.

The configuration is milesial/Pytorch-UNet's documented run: 64 images of 480x320, ``-e 1 -b 4 -s 0.5 --amp`` (bf16
autocast on a CPU, fp16 on CUDA), base 64 (``--quick``: 10 images of 128x96, base 8, batch 2). The run's wall time is
split with the records the trainer writes in ``metrics.jsonl`` (``RunLog.phase``): start-up (launch to the
loop's ``loop_start`` mark: interpreter, imports, data set, model), steps (the loop's start to the first validation),
validation, checkpoint writes, curves, and the rest (after the last record until the process exited).

The compute bound is the epoch's matrix-product FLOPs (forward + backward per training image, forward per validation
image, counted by ``FlopCounterMode``) at this device's measured matmul peak of the run's precision: the time the
epoch would take if every FLOP ran at the peak and nothing else took time.

The milesial ratio: milesial's own ``train.py`` cannot be downloaded here, so its documented loop is timed instead
(``scripts.bench.milesial_baseline``, our stand-in, same flags, same network), as a whole process like ``train.py``.
The two runs alternate, ``--repeat`` pairs; the ratio is the baseline's wall time over ours, the median of the pairs,
and the split shown is that of our run in the median pair.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts.bench.context import Context
from scripts.bench.demo_data import write_linked_dataset
from scripts.bench.processes import REPO_ROOT, MeasurementError, call_worker, run_child, tail
from scripts.bench.report import reliability
from scripts.bench.run_log import check_precision
from utils.checkpoint.run_folder import RunFolder

SECTION = "epoch"
# Distinct scenes drawn for the epoch's data; the other files are hard links (decoding cost is the same).
DISTINCT_SCENES = 8


@dataclass(frozen=True)
class EpochSettings:
    """One epoch's configuration (the full one, or ``--quick``'s)."""

    images: int
    size: tuple[int, int]
    """Image files' ``(width, height)``; the network sees them at ``scale``."""
    batch_size: int
    scale: float
    base_channels: int


FULL = EpochSettings(images=64, size=(480, 320), batch_size=4, scale=0.5, base_channels=64)
QUICK = EpochSettings(images=10, size=(128, 96), batch_size=2, scale=0.5, base_channels=8)


def amp_precision(device: str) -> str:
    """What ``--amp`` selects: bf16 on a CPU, fp16 on CUDA (``utils.hardware.resolve_precision``)."""
    from utils.hardware import resolve_precision

    return resolve_precision(None, True, device)


def run_epoch(ctx: Context) -> dict[str, Any]:
    """``train.py`` epochs of milesial's flags alternating with the milesial stand-in's: the median pair's split, its
    fraction of the compute bound, and the stand-in's time over ours."""
    config = ctx.config
    settings = QUICK if config.quick else FULL
    data = write_linked_dataset(
        ctx.work_dir / f"epoch-data-{settings.size[0]}x{settings.size[1]}",
        settings.images,
        settings.size,
        distinct=min(DISTINCT_SCENES, settings.images),
    )
    precision = amp_precision(config.device)
    runs = ctx.work_dir / "runs"
    name = f"epoch-{precision}"
    run_dir = runs / name
    argv = [
        "--imgs", str(data / "imgs"), "--masks", str(data / "masks"), "-e", "1", "-b", str(settings.batch_size),
        "-s", str(settings.scale), "--amp", "--base-channels", str(settings.base_channels),
        "--checkpoint-dir", str(runs), "--exp_name", name, "--seed", "0", "--wandb", "disabled",
        "--device", config.device, "--threads", str(config.threads),
    ]  # fmt: skip
    if config.num_workers is not None:
        argv += ["--num-workers", str(config.num_workers)]
    load_before = os.getloadavg()[0]
    pairs = []
    for index in range(config.repeat):
        ours = _run_train_py(ctx, argv, run_dir, name, precision)
        baseline = run_baseline(ctx, data, settings, precision, index)
        pairs.append((ours, baseline))
    load_after = os.getloadavg()[0]
    ratios = [baseline["wall_s"] / ours["wall_s"] for ours, baseline in pairs]
    ours, baseline = pairs[ratios.index(statistics.median_low(ratios))]
    summary, split = ours["run"], ours["split_s"]
    bound = call_worker(
        "epoch-bound",
        {
            "base_channels": settings.base_channels,
            "classes": config.classes,
            "height": round(settings.size[1] * settings.scale),
            "width": round(settings.size[0] * settings.scale),
            # One epoch: every training image once, every validation image once.
            "train_images": summary["train_images"],
            "val_images": summary["val_images"],
            "precision": precision,
            "device": config.device,
            "peak_max_size": config.peak_max_size,
        },
        threads=config.threads,
        config=config,
        log_dir=ctx.log_dir,
    )
    result = {
        "settings": {**settings.__dict__, "size": f"{settings.size[0]}x{settings.size[1]}"},
        "train_argv": argv,
        "run": summary,
        "wall_s": ours["wall_s"],
        "wall_s_runs": [pair[0]["wall_s"] for pair in pairs],
        "split_s": split,
        **bound,
        "fraction_of_bound": bound["bound_s"] / ours["wall_s"],
        "steps_fraction_of_bound": bound["train_bound_s"] / split["steps"] if split["steps"] > 0 else None,
        "max_rss_mib": ours["max_rss_mib"],
        "milesial_ratio": statistics.median(ratios),
        "milesial_ratios": ratios,
        "milesial_baseline": {**baseline, "wall_s_runs": [pair[1]["wall_s"] for pair in pairs]},
        "load_average": [load_before, load_after],
    }
    ctx.remember_memory(f"train.py {name}", result)
    ctx.remember_memory("milesial baseline", baseline)
    _rows(ctx, result, settings, precision)
    return result


def _run_train_py(ctx: Context, argv: list[str], run_dir: Path, name: str, precision: str) -> dict[str, Any]:
    """One ``train.py`` epoch in a fresh run folder: its wall time, its log's summary and its split."""
    config = ctx.config
    shutil.rmtree(run_dir, ignore_errors=True)
    launched = time.time()
    run = run_child(
        [sys.executable, str(REPO_ROOT / "train.py"), *argv],
        threads=config.threads,
        timeout=config.timeout,
        log_path=ctx.log_dir / f"{name}.log",
    )
    if run.returncode != 0:
        raise MeasurementError(f"{name}: train.py exited with {run.returncode}:\n{tail(run.output)}")
    summary = check_precision(run.output, precision, name)
    events = [json.loads(line) for line in RunFolder(run_dir).metrics.read_text().splitlines() if line.strip()]
    return {
        "wall_s": run.wall_s,
        "run": summary,
        "split_s": split_wall_time(events, launched=launched, wall_s=run.wall_s),
        "max_rss_mib": run.max_rss_mib,
    }


def run_baseline(ctx: Context, data: Path, settings: EpochSettings, precision: str, index: int) -> dict[str, Any]:
    """One epoch of the milesial stand-in with the same flags, as a whole process; refused if it trained in another
    precision than ``train.py`` or wrote no checkpoint."""
    from scripts.bench.milesial_baseline import read_result

    config = ctx.config
    checkpoint_dir = ctx.work_dir / "runs" / "milesial-baseline"
    shutil.rmtree(checkpoint_dir, ignore_errors=True)
    argv = [
        "--imgs", str(data / "imgs"), "--masks", str(data / "masks"), "--checkpoint-dir", str(checkpoint_dir),
        "-e", "1", "-b", str(settings.batch_size), "-s", str(settings.scale), "--amp",
        "--base-channels", str(settings.base_channels), "--device", config.device,
    ]  # fmt: skip
    log_path = ctx.log_dir / f"milesial-baseline-{index}.log"
    run = run_child(
        [sys.executable, "-m", "scripts.bench.milesial_baseline", *argv],
        threads=config.threads,
        timeout=config.timeout,
        log_path=log_path,
    )
    result = read_result(run.output)
    if run.returncode != 0 or result is None:
        raise MeasurementError(f"milesial baseline exited with {run.returncode}:\n{tail(run.output)}")
    if result["precision"] != precision:
        raise MeasurementError(f"milesial baseline trained in {result['precision']}, train.py in {precision}")
    if not Path(result["checkpoint"]).is_file():
        raise MeasurementError(f"milesial baseline wrote no checkpoint {result['checkpoint']}; see {log_path}")
    return {**result, "inner_wall_s": result["wall_s"], "wall_s": run.wall_s, "max_rss_mib": run.max_rss_mib}


def split_wall_time(events: list[dict[str, Any]], *, launched: float, wall_s: float) -> dict[str, float]:
    """Seconds of start-up, steps, validation, checkpoint writes, curves and the rest, from ``metrics.jsonl``.

    Curves drawn during a validation (the redraw after it) count as curves, not validation.
    """
    phases = [e for e in events if e.get("event") == "phase"]
    starts = [e["time"] for e in phases if e["phase"] == "loop_start"]
    if not starts:
        raise MeasurementError("metrics.jsonl has no loop_start record: is train.py older than this benchmark?")
    loop_start = starts[0]
    spans = {
        kind: [(e["time"] - e["seconds"], e["time"]) for e in phases if e["phase"] == kind]
        for kind in ("validation", "checkpoint", "curves")
    }
    curves_in_validation = sum(
        end - start
        for start, end in spans["curves"]
        if any(v_start <= start and end <= v_end for v_start, v_end in spans["validation"])
    )
    first_after_steps = min((start for kind in spans.values() for start, _ in kind), default=launched + wall_s)
    split = {
        "startup": loop_start - launched,
        "steps": first_after_steps - loop_start,
        "validation": sum(end - start for start, end in spans["validation"]) - curves_in_validation,
        "checkpoint": sum(end - start for start, end in spans["checkpoint"]),
        "curves": sum(end - start for start, end in spans["curves"]),
    }
    split["rest"] = wall_s - sum(split.values())
    return split


def bound_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """The epoch's FLOPs (training images forward + backward, validation images forward) and the matmul peak."""
    import torch

    from scripts.bench.flops import inference_flops_per_image, measure_matmul_peak, training_flops_per_image
    from unet import UNet
    from utils.training.objective import segmentation_loss

    classes = spec["classes"]

    def build() -> UNet:
        return UNet(n_channels=3, n_classes=classes, base_channels=spec["base_channels"])

    def loss_fn(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        return segmentation_loss(logits, masks, classes)

    shape = {"channels": 3, "height": spec["height"], "width": spec["width"]}
    train_flops = training_flops_per_image(build, loss_fn, **shape) * spec["train_images"]
    val_flops = inference_flops_per_image(build, **shape) * spec["val_images"]
    peak = measure_matmul_peak(spec["precision"], torch.device(spec["device"]), max_size=spec["peak_max_size"] or None)
    return {
        "train_images": spec["train_images"],
        "val_images": spec["val_images"],
        "flops": train_flops + val_flops,
        "train_flops": train_flops,
        "matmul_peak_flops_per_s": peak.flops_per_s,
        "bound_s": (train_flops + val_flops) / peak.flops_per_s,
        "train_bound_s": train_flops / peak.flops_per_s,
    }


def _rows(ctx: Context, result: dict[str, Any], settings: EpochSettings, precision: str) -> None:
    split = result["split_s"]
    width, height = settings.size
    peak_zero = result["matmul_peak_flops_per_s"] <= 0
    result["reliability"] = reliability(
        result["wall_s_runs"], result["load_average"], "a matmul peak of 0" if peak_zero else ""
    )
    ctx.row(
        SECTION,
        f"train.py 1 epoch, {settings.images} images {width}x{height} -s {settings.scale:g} -b {settings.batch_size} "
        f"--amp ({precision}), base {settings.base_channels}",
        f"{result['wall_s']:.3g} s{result['reliability']['mark']}",
        f"{result['fraction_of_bound']:.2f} of the compute bound {result['bound_s']:.3g} s "
        f"({result['flops'] / 1e9:.4g} GFLOP at {result['matmul_peak_flops_per_s'] / 1e9:.0f} GFLOP/s)",
    )
    parts = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in split.items())
    steps_note = ""
    if result["steps_fraction_of_bound"] is not None:
        steps_note = f"; the steps alone {result['steps_fraction_of_bound']:.2f} of their bound"
    ctx.row(SECTION, "wall time split", parts, f"{result['run']['threads']} threads{steps_note}")
    baseline = result["milesial_baseline"]
    ratios = ", ".join(f"{r:.2f}" for r in result["milesial_ratios"])
    ctx.row(
        SECTION,
        "milesial stand-in / train.py, same flags",
        f"{result['milesial_ratio']:.2f}x",
        f"median of {len(result['milesial_ratios'])} alternating pairs ({ratios}); stand-in "
        f"{baseline['wall_s']:.3g} s, train.py {result['wall_s']:.3g} s (median pair); load "
        f"{result['load_average'][0]:.2f} -> {result['load_average'][1]:.2f}",
    )
