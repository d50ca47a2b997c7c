"""What the benchmark reports: machine facts, the memory section's rows, the table and the JSON document."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from scripts.bench.context import BenchConfig, Context
from utils.hardware import available_cpus, cpu_has_native

SCHEMA_VERSION = 1
# Repeats of one figure further apart than this fraction of their median make it unreliable (other work on the cores).
UNRELIABLE_SPREAD = 0.2
# End-to-end above compute-only by more than this is impossible (the loop does the compute and more): a busy machine.
IMPOSSIBLE_E2E_RATIO = 1.2


def machine_info(config: BenchConfig) -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cpus_available": available_cpus(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_native_bf16": cpu_has_native("bf16"),
        "device": config.device,
        "load_average_start": os.getloadavg()[0],
    }
    if config.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    return info


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def run_memory(ctx: Context) -> dict[str, Any]:
    """The memory section: a row per measured process, from what the other sections remembered."""
    for entry in ctx.memory:
        cuda = entry["cuda_max_allocated_mib"]
        note = f"CUDA max allocated {cuda:.0f} MiB" if cuda is not None else ""
        if not entry["isolated"]:
            note = (note + "; " if note else "") + "in the benchmark's process: peak so far, not per measurement"
        ctx.row("memory", f"peak RSS, {entry['process']}", f"{entry['max_rss_mib']:.0f} MiB", note)
    return {"processes": ctx.memory}


def ratio_spread(ratios: Sequence[float]) -> str:
    """`` (median of N: r1, r2, ...)`` after a median ratio of paired runs; nothing for a single run."""
    return f" (median of {len(ratios)}: {', '.join(f'{r:.2f}' for r in ratios)})" if len(ratios) > 1 else ""


def reliability(repeats: Sequence[float], load_average: Sequence[float], impossible: str = "") -> dict[str, Any]:
    """The reliability marks of a figure measured ``len(repeats)`` times: its repeats, their spread ((max - min) /
    median), the load average before and after, and whether it can be trusted; ``impossible`` names a physical
    contradiction found by the caller. ``mark`` is what the table appends to the value."""
    middle = sorted(repeats)[len(repeats) // 2] if repeats else 0.0
    spread = (max(repeats) - min(repeats)) / abs(middle) if len(repeats) > 1 and middle else None
    reasons = []
    if spread is not None and spread > UNRELIABLE_SPREAD:
        reasons.append(f"repeats spread {100 * spread:.0f} %")
    if impossible:
        reasons.append(impossible)
    return {
        "repeats": list(repeats),
        "spread": spread,
        "load_average": list(load_average),
        "reliable": not reasons,
        "unreliable_because": reasons,
        "mark": f" UNRELIABLE ({'; '.join(reasons)})" if reasons else "",
    }


def format_table(rows: Sequence[tuple[str, str, str, str]]) -> str:
    header = ("section", "measurement", "value", "note")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(3)]
    lines = []
    for row in [header, *rows]:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)) + "  " + row[3])
        if row is header:
            lines.append("  ".join("-" * width for width in widths) + "  " + "-" * 4)
    return "\n".join(line.rstrip() for line in lines)


def new_document(config: BenchConfig) -> dict[str, Any]:
    """The JSON document before any section ran (``complete`` turns true at the end)."""
    return {"schema": SCHEMA_VERSION, "complete": False, "machine": machine_info(config), "settings": settings(config)}


def update_document(document: dict[str, Any], ctx: Context, started: float) -> None:
    """Add the results so far; with ``--json``, rewrite the file atomically so a run cut short keeps its figures."""
    document.update(ctx.results)
    document["machine"]["load_average_end"] = os.getloadavg()[0]
    document["wall_s"] = time.perf_counter() - started
    document["table"] = format_table(ctx.rows)
    document["rows"] = [list(row) for row in ctx.rows]
    path = ctx.config.json_path
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.tmp")
        partial.write_text(json.dumps(document, indent=2) + "\n")
        os.replace(partial, path)


def settings(config: BenchConfig) -> dict[str, Any]:
    values = asdict(config)
    for key in ("data_dir", "json_path", "work_dir"):
        values[key] = None if values[key] is None else str(values[key])
    values["size"] = f"{config.size[0]}x{config.size[1]}"
    values["full_size"] = f"{config.full_size[0]}x{config.full_size[1]}"
    return values
