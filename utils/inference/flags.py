"""Command-line flags that ``predict.py`` and ``evaluate.py`` share, defined once so they keep one meaning."""

from __future__ import annotations

import argparse

from utils.cli import DEVICE_HELP, device_flag
from utils.errors import ConfigError
from utils.hardware import PRECISIONS
from utils.machine_bounds import check_workers


def add_model_check_flags(parser: argparse.ArgumentParser) -> None:
    """``--bilinear``/``--classes``: milesial's model flags, kept for files that do not store the model's arguments."""
    parser.add_argument(
        "--bilinear",
        action="store_true",
        help="expect bilinear upsampling (the checkpoint decides; a mismatch is an error)",
    )
    parser.add_argument(
        "--classes", "-c", type=int, help="expected number of classes (the checkpoint decides; a mismatch is an error)"
    )


def add_scale_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scale",
        "-s",
        type=float,
        default=None,
        help="downscaling factor of the images (default: the checkpoint's training scale; 0.5 if it records none)",
    )


def add_compute_flags(parser: argparse.ArgumentParser, *, workers_help: str) -> None:
    """``--batch-size``, ``--precision``, ``--device`` and ``--workers`` (whose work ``workers_help`` names)."""
    parser.add_argument("--batch-size", "-b", type=int, default=4, help="images per forward pass (4)")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32", help="forward-pass precision")
    parser.add_argument("--device", type=device_flag, default="auto", help=DEVICE_HELP)
    parser.add_argument("--workers", "-j", type=int, default=2, help=f"{workers_help} worker processes (2)")


def add_progress_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (there is none when stderr is not a terminal)"
    )


def check_compute_flags(scale: float | None, batch_size: int, workers: int, *, workers_job: str) -> None:
    """Raise ``ConfigError`` naming the flag when ``--scale``, ``--batch-size`` or ``--workers`` is out of range."""
    if scale is not None and not 0.0 < scale <= 1.0:
        raise ConfigError(f"--scale {scale}: use a factor in (0, 1]")
    if batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size}: use 1 or more")
    if workers < 0:
        raise ConfigError(f"--workers {workers}: use 0 ({workers_job} in the main process) or more")
    check_workers(workers, "--workers")
