"""What a run reports: ``metrics.jsonl`` in the run folder, optional TensorBoard events and Weights & Biases.

Only global rank 0 writes metrics; other ranks log warnings only. Log lines go to stdout so that stderr carries
progress bars and, on failure, the one ``Error: ...`` line. wandb is imported only when ``--wandb`` is not
``disabled``, so the default run neither needs it nor sends anything.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from utils.checkpoint.run_folder import RunFolder
from utils.output_files import open_for_append
from utils.training.tensorboard_log import TensorBoardLog

logger = logging.getLogger(__name__)

WANDB_PROJECT = "U-Net"
SAMPLE_IMAGES = 4  # validation images (with true and predicted masks) shown per validation


class RunReporter:
    """metrics.jsonl (+ TensorBoard, wandb) of one run; a no-op on ranks other than 0.

    ``resumed_step``: the global step a resumed run continues from (None for a new run), where TensorBoard's step
    axis goes on.
    """

    def __init__(
        self,
        run_folder: RunFolder,
        *,
        enabled: bool,
        wandb_mode: str,
        run_name: str,
        config: dict[str, Any],
        tensorboard: bool = False,
        resumed_step: int | None = None,
    ) -> None:
        self.enabled = enabled
        self.metrics_path = run_folder.metrics
        self.curves_path = run_folder.curves
        self._wandb_run = None
        self._tensorboard: TensorBoardLog | None = None
        if not enabled:
            return
        run_dir = run_folder.path
        run_dir.mkdir(parents=True, exist_ok=True)
        # Appending keeps the history of a resumed run in the same file; the curves keep the last value per step.
        # A torn last line (a crash mid-write) is ended first, so it cannot swallow the next record.
        self._metrics_file = open_for_append(self.metrics_path)
        if tensorboard:
            self._tensorboard = TensorBoardLog(run_folder.tensorboard, resumed_step=resumed_step)
        if wandb_mode != "disabled":
            self._wandb_run = _start_wandb(run_dir, wandb_mode, run_name, config)

    def log_train(self, *, epoch: int, global_step: int, loss: float, lr: float, images_per_s: float, images_seen: int):
        self._write(
            {
                "event": "train",
                "epoch": epoch,
                "global_step": global_step,
                "loss": loss,
                "lr": lr,
                "images_per_s": images_per_s,
                "images_seen": images_seen,
                "time": time.time(),
            }
        )
        if self._wandb_run is not None:
            record = {"train loss": loss, "learning rate": lr, "images/s": images_per_s}
            self._guard_wandb(lambda: self._wandb_run.log(record, step=global_step))
        if self._tensorboard is not None:
            self._tensorboard.log_train(global_step, loss=loss, lr=lr, images_per_s=images_per_s)

    def log_val(self, *, epoch: int, global_step: int, result: Any, samples: dict[str, Any] | None = None) -> None:
        """``result`` is an EvalResult; ``samples`` optional image/true/pred tensors for wandb."""
        self._write(
            {
                "event": "val",
                "epoch": epoch,
                "global_step": global_step,
                "dice": result.dice,
                "iou": result.iou,
                "per_class_dice": result.per_class_dice,
                "per_class_iou": result.per_class_iou,
                "n_images": result.n_images,
                # Macro (per-image mean) and micro (dataset-level) scores, per class and averaged; see utils.evaluation.
                "reductions": result.reductions(),
                "time": time.time(),
            }
        )
        if self._wandb_run is not None:
            self._guard_wandb(lambda: self._log_val_wandb(global_step, result, samples))
        if self._tensorboard is not None:
            self._tensorboard.log_val(global_step, result, samples)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a part of the run outside the optimizer steps (validation, a checkpoint write, the curves).

        One ``{"event": "phase", "phase": name, "seconds": ..., "time": end}`` record: the benchmark's epoch section
        splits a run's wall time with these (``scripts/bench/epoch.py``).
        """
        started = time.perf_counter()
        try:
            yield
        finally:
            self._write_phase(name, time.perf_counter() - started)

    def mark(self, name: str) -> None:
        """A 0 s phase record: a moment of the run (``loop_start``: the training loop begins)."""
        self._write_phase(name, 0.0)

    def _write_phase(self, name: str, seconds: float) -> None:
        self._write({"event": "phase", "phase": name, "seconds": seconds, "time": time.time()})

    def wants_samples(self) -> bool:
        return self._wandb_run is not None or self._tensorboard is not None

    def close(self) -> None:
        if not self.enabled:
            return
        self._metrics_file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def _write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        # One complete line per event, flushed, so a reader polling the file (or a crash) never sees half a record.
        self._metrics_file.write(json.dumps(record) + "\n")
        self._metrics_file.flush()

    def _guard_wandb(self, log: Any) -> None:
        # Telemetry must never end a training run: on any wandb failure, warn once and continue without it.
        try:
            log()
        except Exception as error:
            logger.warning("wandb logging failed (%s); continuing without wandb", error)
            self._wandb_run = None

    def _log_val_wandb(self, global_step: int, result: Any, samples: dict[str, Any] | None) -> None:
        import wandb

        record: dict[str, Any] = {"validation Dice": result.dice, "validation IoU": result.iou}
        for index, (dice, iou) in enumerate(zip(result.per_class_dice, result.per_class_iou, strict=True)):
            record[f"validation Dice/class {index}"] = dice
            record[f"validation IoU/class {index}"] = iou
        if samples is not None:
            # The first of the samples (TensorBoard shows them all).
            record["images"] = wandb.Image(samples["image"][0].float().cpu().permute(1, 2, 0).numpy())
            # Class indices spread over the grey range so that the masks are visible.
            scale = 255 // max(len(result.per_class_dice) - 1, 1)
            record["masks"] = {
                "true": wandb.Image((samples["true"][0].cpu() * scale).byte().numpy()),
                "pred": wandb.Image((samples["pred"][0].cpu() * scale).byte().numpy()),
            }
            for name, values in samples.get("histograms", {}).items():
                record[name] = wandb.Histogram(values.float().cpu())
        self._wandb_run.log(record, step=global_step)


def _start_wandb(run_dir: Path, mode: str, run_name: str, config: dict[str, Any]) -> Any:
    try:
        import wandb
    except ImportError:
        logger.warning("--wandb %s but wandb is not installed; continuing without it (pip install wandb)", mode)
        return None
    try:
        return wandb.init(project=WANDB_PROJECT, name=run_name, config=config, mode=mode, dir=str(run_dir))
    except Exception as error:  # wandb raises many kinds (network, auth); none should stop training
        logger.warning("wandb could not start (%s); continuing without it", error)
        return None


def weight_and_grad_histograms(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weights and gradients per parameter, for wandb histograms at validation time."""
    histograms: dict[str, torch.Tensor] = {}
    for name, parameter in model.named_parameters():
        tag = name.replace("/", ".")
        if torch.isfinite(parameter).all():
            histograms[f"Weights/{tag}"] = parameter.detach()
        if parameter.grad is not None and torch.isfinite(parameter.grad).all():
            histograms[f"Gradients/{tag}"] = parameter.grad.detach()
    return histograms
