"""How the data part's process pools (the mask scan, ``build-cache``) start their workers."""

from __future__ import annotations

import multiprocessing
import sys


def pool_context() -> multiprocessing.context.BaseContext:
    """fork on Linux, spawn elsewhere.

    fork starts workers in milliseconds and lets them inherit the caller's objects (DataLoader forks on Linux too).
    spawn/forkserver would re-import the caller's __main__ (e.g. train.py and torch) in every worker.
    """
    if sys.platform == "linux":
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")
