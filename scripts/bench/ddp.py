"""The ddp section: 2 processes with half the threads each against 1 process with all of them, same global batch."""

from __future__ import annotations

import statistics
from typing import Any

import torch

from scripts.bench.context import DDP_PROCESSES, Context
from scripts.bench.demo_data import ensure_demo_data
from scripts.bench.report import ratio_spread
from scripts.bench.training import median_run, train_run


def run_ddp(ctx: Context) -> dict[str, Any]:
    """Single- and two-process ``train.py`` runs, alternating ``--repeat`` times; the median of their ratios."""
    config = ctx.config
    precision = config.precisions[0]
    if config.device == "cuda" and torch.cuda.device_count() < DDP_PROCESSES:
        ctx.row("ddp", "skipped", "-", f"needs {DDP_PROCESSES} GPUs, {torch.cuda.device_count()} visible")
        return {"skipped": f"needs {DDP_PROCESSES} GPUs"}
    data = ensure_demo_data(ctx)
    singles, multis = [], []
    for repeat in range(config.repeat):
        suffix = f"{precision}" + (f"-{repeat + 1}" if config.repeat > 1 else "")
        single = ctx.results.get("e2e", {}).get(precision)
        # The e2e run just before this section is a single-process run of the same settings: reuse it when it is
        # the most recent run (one precision, one repeat) instead of paying for another one.
        reusable = single is not None and config.repeat == 1 and config.precisions == [precision]
        if not reusable:
            single = train_run(ctx, data, precision, processes=1, name=f"ddp-single-{suffix}")
        singles.append(single)
        multis.append(train_run(ctx, data, precision, processes=DDP_PROCESSES, name=f"ddp-{DDP_PROCESSES}-{suffix}"))
    single, multi = median_run(singles), median_run(multis)
    ratios = [m["images_per_s"] / s["images_per_s"] for s, m in zip(singles, multis, strict=True)]
    threads_each = max(1, config.threads // DDP_PROCESSES)
    result = {
        "precision": precision,
        "global_batch": config.batch_size,
        "single": {"processes": 1, "threads": config.threads, **_pick(single)},
        "multi": {"processes": DDP_PROCESSES, "threads_per_process": threads_each, **_pick(multi)},
        "ratios": ratios,
        "ratio": statistics.median(ratios),
    }
    spread = ratio_spread(ratios)
    ctx.row(
        "ddp",
        f"{precision} {DDP_PROCESSES} proc x {threads_each} thr vs 1 proc x {config.threads} thr",
        f"{multi['images_per_s']:.3g} vs {single['images_per_s']:.3g} img/s",
        f"ratio {result['ratio']:.2f}{spread} (global batch {config.batch_size})",
    )
    return result


def _pick(run: dict[str, Any]) -> dict[str, Any]:
    keys = ("images_per_s", "images_per_s_runs", "steps_timed", "seconds_timed", "max_rss_mib", "wall_s")
    return {key: run.get(key) for key in keys}
