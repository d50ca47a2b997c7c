"""Timing on a device that may run asynchronously (CUDA): synchronise at the edges of what is timed."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from scripts.bench.context import MIB


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(run: Callable[[], object], device: torch.device) -> float:
    """Seconds of one ``run()``, synchronised before and after."""
    sync(device)
    started = time.perf_counter()
    run()
    sync(device)
    return time.perf_counter() - started


def cuda_max_allocated_mib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / MIB if device.type == "cuda" else None
