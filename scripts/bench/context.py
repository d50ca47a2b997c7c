"""The benchmark's settings and what its sections share while they run."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# In the order they run (the checkpoint section last: it builds its trainer in the benchmark's own process).
SECTIONS = (
    "compute", "e2e", "epoch", "compile", "ddp", "validation", "data", "startup", "predict", "memory", "checkpoint",
)  # fmt: skip
# Carvana's image size: the data section's "full-size" masks.
CARVANA_SIZE = (1918, 1280)
DDP_PROCESSES = 2
MIB = 1024 * 1024


@dataclass
class BenchConfig:
    """Everything one benchmark run measures; ``--quick`` changes the defaults of the fields the user left unset."""

    sections: list[str]
    device: str
    """``cpu`` or ``cuda`` (``--device auto`` resolved)."""
    size: tuple[int, int]
    """Network input ``(width, height)``."""
    batch_size: int
    """Global batch: one process trains all of it; in the DDP section each of the 2 processes trains half."""
    base_channels: int
    classes: int
    precisions: list[str]
    steps: int
    """Timed optimizer steps per measurement."""
    warmup: int
    """Untimed steps before them (first-step allocations, autotuning, compilation)."""
    repeat: int
    """Alternating (compute, e2e) and (1 process, DDP) pairs per precision; ratios are the pairs' median."""
    threads: int
    """CPU threads of one training process; DDP ranks get ``threads // 2`` each."""
    scale: float
    """``--scale`` of the training and prediction runs; demo images are drawn at ``size / scale``."""
    data_dir: Path | None
    """Folder with ``imgs/`` and ``masks/`` for training; demo data is drawn there when missing."""
    n_masks: int
    full_size: tuple[int, int]
    full_scale: float
    """``--scale`` of the full-size per-item figure (0.5: Carvana's usual 959x640 training input)."""
    items: int
    """Items timed per per-item figure."""
    loader_workers: list[int]
    loader_batches: int
    predict_batch_sizes: list[int]
    predict_images: int
    predict_workers: int
    peak_max_size: int
    """Largest matmul side timed for the peak (0: the device's default)."""
    num_workers: int | None
    """``--num-workers`` of train.py (None: its default)."""
    pixel_cache: list[str]
    """e2e runs without (``off``) and/or with (``on``) train.py's ``--pixel-cache``, filled up front by build-cache."""
    startup_pairs: list[int]
    """Small pairs of the startup section's second-start figures."""
    log_every: int
    channels_last: bool
    compile: bool
    isolate: bool
    timeout: float
    json_path: Path | None
    work_dir: Path | None
    quick: bool


@dataclass
class Context:
    """What the sections share: settings, folders, the results so far and the table rows."""

    config: BenchConfig
    work_dir: Path
    results: dict[str, Any] = field(default_factory=dict)
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)

    @property
    def log_dir(self) -> Path:
        return self.work_dir / "logs"

    def row(self, section: str, measurement: str, value: str, note: str = "") -> None:
        self.rows.append((section, measurement, value, note))

    def remember_memory(self, process: str, result: dict[str, Any]) -> None:
        self.memory.append(
            {
                "process": process,
                "max_rss_mib": result.get("max_rss_mib"),
                "cuda_max_allocated_mib": result.get("cuda_max_allocated_mib"),
                "isolated": result.get("isolated", True),
            }
        )


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def logged_total_steps(config: BenchConfig) -> int:
    """Warm-up plus timed steps, rounded up to a logged step so that the last step is in metrics.jsonl."""
    wanted = config.warmup + config.steps
    return math.ceil(wanted / config.log_every) * config.log_every
