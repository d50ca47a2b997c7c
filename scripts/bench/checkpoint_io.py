"""The checkpoint section: what saving, copying, loading and verifying a training checkpoint costs.

The payload is the one ``train.py`` writes: the run is built by ``train.py``'s own set-up (``build_trainer`` from the
flags the e2e run gets, at ``--checkpoint-base-channels``), its ``TrainStep`` runs once so that AdamW holds its state,
and ``Checkpointer.payload`` builds the dictionary every save writes.
Every figure then times a function of ``utils.checkpoint`` itself: the digests alone (``tensor_digests``), a full
save (``save_checkpoint_atomic``: digests, ``torch.save``, fsync, rename, folder fsync), one more name by a byte copy
(``copy_checkpoint_atomic``, what training does for best.pth and checkpoint_epochN.pth) against one more name by a
second save, a load (``load_resume_checkpoint``, what ``--resume`` reads; ``predict.py`` goes through the same
``load_checkpoint_file``) and the verification alone (``verify_checkpoint``: digests and finite weights).

The files go to a temporary folder inside ``--checkpoint-bench-dir``, or inside the folder the benchmark's runs use as
``--checkpoint-dir``, so the figures are those of that filesystem; the folder is removed afterwards. The pair (copy,
second save) alternates ``--repeat`` times, each later save replacing the file before it as training replaces
last.pth; every figure is the median of its runs, the ratio the median of the pairs' ratios. Loads read a file just
written, so they come from the page cache, as a resume right after a save would (a cold read adds the disk's time).

The section runs in the benchmark's own process, not in a worker of its own (``scripts.bench.processes.WORKERS``
has no entry for it yet), with the ``--threads`` that ``train.py``'s set-up gives it; its figures are mostly file work
and hashing, which a fresh process would hardly change, and peak memory is not reported for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from scripts.bench.context import Context
from scripts.bench.demo_data import ensure_demo_data
from scripts.bench.processes import MeasurementError
from scripts.bench.report import ratio_spread
from scripts.bench.timing import timed
from scripts.bench.training import built_trainer, runs_folder, train_argv
from utils.checkpoint.files import copy_checkpoint_atomic, save_checkpoint_atomic
from utils.checkpoint.format import tensor_digests, verify_checkpoint
from utils.errors import UserError

if TYPE_CHECKING:
    from utils.training.loop import Trainer

SECTION = "checkpoint"
MB = 1_000_000
# The optimizer step only has to create AdamW's state, whose size does not depend on the input's: a corner of the
# loader's first batch (a multiple of the UNet's 16-pixel stride) keeps a base-64 step on a CPU under a second.
STEP_CROP = 32
# The timed operations, in the order of one repeat; each is reported as the median of its runs.
MEASURES = ("payload", "digest", "save", "copy", "second_save", "load", "verify")


@dataclass(frozen=True)
class CheckpointBenchConfig:
    """What the checkpoint section measures (from ``--checkpoint-base-channels`` and ``--checkpoint-bench-dir``)."""

    base_channels: int = 64
    """UNet width of the checkpoint; base 64 with AdamW state is a 373 MB file."""
    folder: Path | None = None
    """Where the temporary folder of the files is made; None: the benchmark's run folders (its ``--checkpoint-dir``)."""


def run_checkpoint(ctx: Context, settings: CheckpointBenchConfig) -> dict[str, Any]:
    """Build the real payload once, then time each checkpoint operation ``--repeat`` times; rows and the result."""
    config = ctx.config
    precision = config.precisions[0]
    name = f"checkpoint-base{settings.base_channels}-{precision}"
    run_config = dataclasses.replace(config, base_channels=settings.base_channels)
    argv = train_argv(run_config, ensure_demo_data(ctx), precision, processes=1, name=name, runs=runs_folder(ctx))
    shutil.rmtree(runs_folder(ctx) / name, ignore_errors=True)
    base = settings.folder or runs_folder(ctx)
    base.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    try:
        with (
            built_trainer(argv) as trainer,
            tempfile.TemporaryDirectory(prefix=".checkpoint-bench-", dir=base) as folder,
        ):
            _one_step(trainer)
            result = _measure(trainer, Path(folder), config.repeat)
    except UserError as error:
        # A full disk or an unwritable --checkpoint-bench-dir fails this section only, like any other measurement.
        raise MeasurementError(str(error)) from error
    finally:
        torch.set_num_threads(threads)  # train.py's set-up sized this process's pool for its run
    result = {"base_channels": settings.base_channels, "precision": precision, **result}
    result["folder"] = str(base)
    result["filesystem"] = filesystem_type(base)
    _rows(ctx, result)
    return result


def _one_step(trainer: Trainer) -> None:
    """One optimizer step of the trainer's ``TrainStep`` on a corner of its first batch: AdamW gets its state."""
    batch = next(iter(trainer.parts.loaders.train))
    crop = {"image": batch["image"][..., :STEP_CROP, :STEP_CROP], "mask": batch["mask"][..., :STEP_CROP, :STEP_CROP]}
    trainer.parts.raw_model.train()
    trainer.step([crop])
    trainer.step.take_losses()
    if not trainer.step.optimizer.state:
        raise MeasurementError("the optimizer step left no optimizer state (it was skipped as non-finite)")


def _measure(trainer: Trainer, folder: Path, repeat: int) -> dict[str, Any]:
    from utils.checkpoint.files import load_checkpoint_file
    from utils.checkpoint.format import TrainingState

    device = trainer.step.device
    first, copied, saved_again = folder / "saved.pth", folder / "copied.pth", folder / "saved-again.pth"
    payload: dict[str, Any] = {}

    def build() -> None:
        payload["value"] = trainer.checkpointer.payload()  # what every save writes

    loaded: dict[str, Any] = {}

    def load() -> None:
        # What load_resume_checkpoint does, the read kept as read for "verify".
        loaded["value"] = load_checkpoint_file(first)
        TrainingState.of(loaded["value"], first)

    operations: dict[str, Callable[[], object]] = {
        "payload": build,
        "digest": lambda: tensor_digests(payload["value"]),
        "save": lambda: save_checkpoint_atomic(payload["value"], first),
        "copy": lambda: copy_checkpoint_atomic(first, copied),
        "second_save": lambda: save_checkpoint_atomic(payload["value"], saved_again),
        "load": load,
        "verify": lambda: verify_checkpoint(loaded["value"], first),
    }
    runs: dict[str, list[float]] = {measure: [] for measure in MEASURES}
    for _ in range(repeat):
        for measure in MEASURES:
            runs[measure].append(timed(operations[measure], device))
        loaded.clear()  # a loaded copy (the size of the file) is not held through the next repeat's saves
    size = first.stat().st_size
    result: dict[str, Any] = {"file_bytes": size, "file_mb": size / MB, "repeat": repeat}
    result["tensors"] = len(tensor_digests(payload["value"]))
    for measure, seconds in runs.items():
        result[f"{measure}_s"] = statistics.median(seconds)
        result[f"{measure}_s_runs"] = seconds
    ratios = [copy / again for copy, again in zip(runs["copy"], runs["second_save"], strict=True)]
    result["copy_over_second_save_runs"] = ratios
    result["copy_over_second_save"] = statistics.median(ratios)
    return result


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding ``path`` (``ext4``, ``tmpfs``...), from /proc/mounts; ``unknown`` elsewhere.

    Reported with the figures because fsync is what they mostly measure, and on tmpfs it costs nothing.
    """
    target = os.path.realpath(path)
    best, kind = "", "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) < 3:
                continue
            # /proc/mounts writes a space in a mount point as \040.
            mount_point = fields[1].replace("\\040", " ")
            inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
            if inside and len(mount_point) >= len(best):
                best, kind = mount_point, fields[2]
    return kind


def _spread(seconds: list[float]) -> str:
    return f" ({min(seconds):.3g}-{max(seconds):.3g}, {len(seconds)} runs)" if len(seconds) > 1 else ""


def _rows(ctx: Context, result: dict[str, Any]) -> None:
    def row(measurement: str, measure: str, note: str = "") -> None:
        ctx.row(SECTION, measurement, f"{result[measure + '_s']:.3g} s{_spread(result[measure + '_s_runs'])}", note)

    what = f"UNet base {result['base_channels']} + AdamW state, {result['file_mb']:.0f} MB on {result['filesystem']}"
    row("Checkpointer.payload (state dicts, RNG state)", "payload", what)
    row("tensor digests alone (sha256)", "digest", f"{result['tensors']} tensors")
    row("save_checkpoint_atomic (digests, torch.save, fsync, rename)", "save", result["folder"])
    ratios = result["copy_over_second_save_runs"]
    spread = ratio_spread(ratios)
    ctx.row(
        SECTION,
        "one more name: copy_checkpoint_atomic / a second save",
        f"{result['copy_s']:.3g} / {result['second_save_s']:.3g} s",
        f"ratio {result['copy_over_second_save']:.2f}{spread}",
    )
    row("load_resume_checkpoint (torch.load + verification)", "load", "file in the page cache")
    row("verify_checkpoint alone (digests + finite weights)", "verify")
