"""The validation section: one validation pass at 2 processes, ``--val-mode rank0`` against ``--val-mode sharded``.

Each measurement is a ``torchrun`` launch of 2 gloo processes running this module. Every rank builds the trainer
from ``train.py``'s flags (``scripts.bench.training.built_trainer``), so the model, the precision, the threads per
process and the validation loader (the whole set on rank 0, or this rank's shard) are the trainer's own. Then, after
a warm-up batch and a barrier, each rank times what ``Validator.validate`` does: it scores its part
(``score_batches`` under ``agree_on_errors``) and the sums are all-reduced. In each mode:

* ``rank0``: rank 0 scores the whole set while the other rank, which has no part, waits in the agreement;
* ``sharded``: every rank scores its shard.

The figure is rank 0's time from the barrier to the score (what the trainer's ``validation`` phase record measures).
Each rank also reports the images it scored and the Dice it got: proof that the run used the mode it is labelled with
(rank0: all images on rank 0, none on rank 1; sharded: disjoint shards covering the set) and that both modes give the
same scores. Training, checkpoints and curves do not run, so a measurement costs a start-up and one pass.
``--repeat N`` alternates the two modes N times; the reported figures are medians.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from scripts.bench.context import DDP_PROCESSES, Context
from scripts.bench.demo_data import write_linked_dataset
from scripts.bench.processes import RESULT_PREFIX, MeasurementError, run_child, tail
from scripts.bench.report import ratio_spread

SECTION = "validation"
MODES = ("rank0", "sharded")
# Distinct scenes drawn; the other files are hard links (decoding cost does not depend on the content).
DISTINCT_SCENES = 8


@dataclass(frozen=True)
class ValidationSettings:
    val_images: int
    """Validation images; the quick set does not divide evenly over 2 ranks (3 and 2)."""


FULL = ValidationSettings(val_images=64)
QUICK = ValidationSettings(val_images=5)


def validation_percent(val_images: int, total: int) -> float:
    """The ``--validation`` percentage that holds out exactly ``val_images`` of ``total``.

    The split takes ``int(total * percent / 100)`` images; half an image of margin keeps float rounding from
    losing one.
    """
    return 100 * (val_images + 0.5) / total


def run_validation(ctx: Context) -> dict[str, Any]:
    """Alternating rank0 and sharded launches, ``--repeat`` times each; the median times and their ratio."""
    config = ctx.config
    if config.device == "cuda" and torch.cuda.device_count() < DDP_PROCESSES:
        ctx.row(SECTION, "skipped", "-", f"needs {DDP_PROCESSES} GPUs, {torch.cuda.device_count()} visible")
        return {"skipped": f"needs {DDP_PROCESSES} GPUs"}
    settings = QUICK if config.quick else FULL
    batch_per_process = max(1, config.batch_size // DDP_PROCESSES)
    # A few training images: the trainer needs some to build, and none of them is trained on.
    train_images = DDP_PROCESSES * batch_per_process
    width, height = config.size
    data = write_linked_dataset(
        ctx.work_dir / "validation-data",
        settings.val_images + train_images,
        (round(width / config.scale), round(height / config.scale)),
        distinct=min(DISTINCT_SCENES, settings.val_images),
    )
    percent = validation_percent(settings.val_images, settings.val_images + train_images)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for repeat in range(config.repeat):
        for mode in MODES:
            name = f"validation-{mode}" + (f"-{repeat + 1}" if config.repeat > 1 else "")
            argv = [
                "--imgs", str(data / "imgs"), "--masks", str(data / "masks"), "--scale", str(config.scale),
                "--validation", repr(percent), "--batch-size", str(batch_per_process),
                "--base-channels", str(config.base_channels), "--classes", str(config.classes),
                "--precision", config.precisions[0], "--epochs", "1", "--ddp_mode", "--val-mode", mode,
                "--checkpoint-dir", str(ctx.work_dir / "runs"), "--exp_name", name, "--seed", "0",
                "--threads", str(max(1, config.threads // DDP_PROCESSES)), "--device", config.device,
                "--wandb", "disabled", "--no-progress",
            ]  # fmt: skip
            if config.num_workers is not None:
                argv += ["--num-workers", str(config.num_workers)]
            runs[mode].append(_launch(ctx, name, argv))
    return _summarise(ctx, runs, settings)


def _launch(ctx: Context, name: str, argv: list[str]) -> dict[str, Any]:
    """One torchrun launch of this module's ``main`` at 2 processes; rank 0's result line, read back."""
    config = ctx.config
    shutil.rmtree(ctx.work_dir / "runs" / name, ignore_errors=True)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={DDP_PROCESSES}"]
    command = [*launcher, "-m", "scripts.bench.validation", json.dumps(argv)]
    load_before = os.getloadavg()[0]
    run = run_child(
        command,
        threads=max(1, config.threads // DDP_PROCESSES),
        timeout=config.timeout,
        log_path=ctx.log_dir / f"{name}.log",
    )
    lines = [line for line in run.output.splitlines() if line.startswith(RESULT_PREFIX)]
    if run.returncode != 0 or not lines:
        # Enough lines to reach a rank's own message above torchrun's summary of the failure.
        raise MeasurementError(
            f"{name}: the validation launch exited with {run.returncode} (log: {ctx.log_dir / f'{name}.log'}):\n"
            f"{tail(run.output, 40)}"
        )
    result = json.loads(lines[-1][len(RESULT_PREFIX) :])
    result["load_average"] = [load_before, os.getloadavg()[0]]
    result["wall_s"] = run.wall_s
    result["max_rss_mib"] = run.max_rss_mib
    ctx.remember_memory(f"validation {name} (largest of {DDP_PROCESSES} ranks)", result)
    return result


def _summarise(ctx: Context, runs: dict[str, list[dict[str, Any]]], settings: ValidationSettings) -> dict[str, Any]:
    times = {mode: [run["seconds"] for run in runs[mode]] for mode in MODES}
    ratios = [r / s for r, s in zip(times["rank0"], times["sharded"], strict=True)]
    first = runs["rank0"][0]
    result = {
        "processes": DDP_PROCESSES,
        "threads_per_process": first["threads"],
        "precision": first["precision"],
        "val_images": settings.val_images,
        "batch_per_process": first["batch_per_process"],
        "runs": runs,
        "rank0_s": statistics.median(times["rank0"]),
        "sharded_s": statistics.median(times["sharded"]),
        "ratios": ratios,
        "ratio": statistics.median(ratios),
    }
    ctx.row(
        SECTION,
        f"{settings.val_images} images, {DDP_PROCESSES} proc x {first['threads']} thr: --val-mode rank0 / sharded",
        f"{result['rank0_s']:.3g} / {result['sharded_s']:.3g} s",
        f"ratio {result['ratio']:.2f}{ratio_spread(ratios)} (images per rank {first['images_per_rank']} / "
        f"{runs['sharded'][0]['images_per_rank']})",
    )
    return result


# ------------------------------------------------------------------------------------------- the ranks' side


class _Counted:
    """Iterates a loader and counts the images it hands out: what this rank really scored."""

    def __init__(self, loader: Iterable[dict[str, torch.Tensor]]) -> None:
        self.loader = loader
        self.images = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for batch in self.loader:
            self.images += batch["image"].shape[0]
            yield batch


def _warm_up(
    model: torch.nn.Module, loader: Iterable[dict[str, torch.Tensor]] | None, device: torch.device, precision: str
) -> None:
    """One untimed batch, so that first-call costs (allocations, kernel selection) stay out of the figure; the
    trainer's validation comes after training steps that paid them."""
    from utils.evaluation import run_model

    if loader is None:
        return
    batch = next(iter(loader), None)
    if batch is None:
        return
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        run_model(model, batch["image"].to(device=device, dtype=torch.float32), precision)
    model.train(was_training)


def main(argv: list[str]) -> None:
    """One rank: build the trainer from ``argv`` and time one validation in its ``--val-mode``; rank 0 prints every
    rank's figures on the line ``_launch`` reads."""
    import torch.distributed as dist

    from scripts.bench.training import built_trainer
    from utils.evaluation import score_batches
    from utils.launch.process_group import agree_on_errors, barrier, sum_across_ranks

    with built_trainer(argv) as trainer:
        ctx, parts = trainer.ctx, trainer.parts
        sharded = parts.loaders.val_sharded
        loader = parts.loaders.val
        model = parts.raw_model
        _warm_up(model, loader, ctx.device, parts.step.precision)
        counted = _Counted(loader) if loader is not None else None
        options = {"n_classes": trainer.config.model.classes, "precision": parts.step.precision, "progress": False}
        barrier(ctx)
        started = time.perf_counter()
        # The same calls as Validator.validate (utils/training/loop.py), less the stop agreement (one integer
        # all-reduce) and the reporting: in either mode the sums are all-reduced (rank0: only rank 0 has a part).
        metrics = agree_on_errors(ctx, lambda: score_batches(model, counted or [], ctx.device, **options))
        metrics.reduce(lambda sums: sum_across_ranks(ctx, sums.to(ctx.device)))
        dice = metrics.compute().dice
        seconds = time.perf_counter() - started
        mine = {"seconds": seconds, "images": counted.images if counted is not None else 0, "dice": float(dice)}
        every_rank: list[dict[str, Any]] = [{} for _ in range(ctx.world_size)]
        dist.all_gather_object(every_rank, mine, group=ctx.control_group)
        if ctx.is_main:
            _print_figures(trainer, every_rank, sharded)
        # Nobody leaves before rank 0 has printed, as at the end of Trainer.train: a rank that left first made gloo
        # abort rank 0 now and then (SIGABRT, in a sharded launch on a loaded machine).
        barrier(ctx)


def _print_figures(trainer: Any, every_rank: list[dict[str, Any]], sharded: bool) -> None:
    """Rank 0: every rank's figures on the line ``_launch`` reads."""
    ctx, parts = trainer.ctx, trainer.parts
    figures = {
        "mode": "sharded" if sharded else "rank0",
        "seconds": every_rank[0]["seconds"],
        "seconds_per_rank": [rank["seconds"] for rank in every_rank],
        "images_per_rank": [rank["images"] for rank in every_rank],
        "dice_per_rank": [rank["dice"] for rank in every_rank],
        "val_images": len(parts.data.val_set),
        "batch_per_process": parts.batch_plan.batch_size,
        "threads": torch.get_num_threads(),
        "precision": parts.step.precision,
        "world_size": ctx.world_size,
    }
    print(RESULT_PREFIX + json.dumps(figures), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
