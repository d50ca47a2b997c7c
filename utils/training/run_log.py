"""What a run tells while it trains: progress bars or log lines, ``metrics.jsonl``, TensorBoard, wandb and curves.png.

Only global rank 0 writes or draws anything; other ranks log warnings only, and take part in the one collective of
logging (the all-reduce of the losses, ``add_losses``). Log lines go to stdout so that stderr carries progress bars
and, on failure, the one ``Error: ...`` line.

Progress bars redraw one line with carriage returns: in a file that is thousands of fragments and no loss at all.
When stderr is not a terminal, or with ``--no-progress``, the bars are off and rank 0 logs one line every
``--log-every`` optimizer steps (epoch, step in the epoch, loss, learning rate, images/s, ETA) and one line per epoch
(mean training loss of the epoch, and the validation scores when it validated). With a terminal the bars stay.

``--tensorboard`` writes the scalars of ``metrics.jsonl`` and a few validation images as events in
``<run>/tensorboard/``, all on the global-step axis. A resumed run writes into the same folder and continues that
axis: its writer starts with ``purge_step`` = the resumed step + 1, so TensorBoard hides what the interrupted run had
logged after its checkpoint and each step is shown once, with the resumed run's values (``tensorboard --logdir
checkpoints`` shows every run folder below, one run each). ``torch.utils.tensorboard`` is imported only with the
flag, and wandb only when ``--wandb`` is not ``disabled``, so the default run neither needs them nor sends anything.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, TextIO

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from utils.checkpoint.run_folder import RunFolder
from utils.checkpoint.state import TrainPosition
from utils.cli import stderr_is_terminal
from utils.errors import ConfigError
from utils.evaluation import EvalResult
from utils.launch.process_group import DistributedContext, sum_across_ranks
from utils.output_files import OutputError, open_for_append, side_output_folder
from utils.training.config import TrainConfig
from utils.training.curves import write_curves_if_possible
from utils.training.sampler import BatchPlan

logger = logging.getLogger(__name__)

WANDB_PROJECT = "U-Net"
SAMPLE_IMAGES = 4  # validation images (with true and predicted masks) shown per validation

ZERO_DICE_HINT = (
    "Dice 0.0000 in the first validations is expected: a model early in training predicts no foreground pixel at "
    "all; it rises once the model starts to find the objects"
)
Scalars = dict[str, tuple[str, float]]
"""wandb name -> (TensorBoard tag, value): one score, named as each of them shows it."""


def bars_wanted(*, is_main: bool, no_progress: bool, stream: TextIO | None = None) -> bool:
    """Progress bars only on global rank 0, on a terminal, and unless ``--no-progress``."""
    return is_main and not no_progress and stderr_is_terminal(sys.stderr if stream is None else stream)


def format_duration(seconds: float) -> str:
    """``1:02:03`` for hours, ``2:03`` below an hour."""
    hours, rest = divmod(max(int(round(seconds)), 0), 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def start_phrase(epochs: tuple[int, int], resumed: TrainPosition | None) -> str:
    """``Starting training: epochs 1..6``, or for a resumed run where in that plan it goes on."""
    first, last = epochs
    if resumed is None:
        return f"Starting training: epochs {first}..{last}"
    return (
        f"Resuming at epoch {resumed.epoch + 1}, step {resumed.global_step} "
        f"({resumed.step_in_epoch} batches of the epoch done) of epochs {first}..{last}"
    )


class RunLog:
    """The run's progress, metrics and curves (``config``: the logging flags, read whole).

    ``config`` holds the run's epoch plan (a resumed run's is its checkpoint's); ``resumed_step``: the global step a
    resumed run continues from (None for a new run), where TensorBoard's step axis goes on.
    """

    def __init__(
        self,
        config: TrainConfig,
        ctx: DistributedContext,
        run_folder: RunFolder,
        plan: BatchPlan,
        *,
        resumed_step: int | None,
    ) -> None:
        self.ctx = ctx
        self.enabled = ctx.is_main
        self.run_folder = run_folder
        self.bars = bars_wanted(is_main=ctx.is_main, no_progress=config.logging.no_progress)
        self._log_lines = ctx.is_main and not self.bars
        self._plan = plan
        self._last_epoch = config.epoch_range()[1]
        self._max_steps = config.optimisation.max_steps
        # Losses summed over ranks as [sum, count]: since the last train line (a window may span an epoch's end), and
        # of this epoch (for the epoch line's mean).
        self._window, self._epoch = [0.0, 0.0], [0.0, 0.0]
        self._last_validation: tuple[float, float] | None = None
        self._scored_any_foreground = False
        self._bar: tqdm | None = None
        self._wandb_run = None
        self._tensorboard = None
        if not self.enabled:
            return
        run_folder.path.mkdir(parents=True, exist_ok=True)
        # Appending keeps the history of a resumed run in the same file; the curves keep the last value per step.
        # A torn last line (a crash mid-write) is dropped first, so it cannot swallow the next record.
        self._metrics_file = open_for_append(run_folder.metrics)
        if config.logging.tensorboard:
            self._tensorboard = _start_tensorboard(run_folder, resumed_step)
        if config.logging.wandb != "disabled":
            self._wandb_run = _start_wandb(run_folder, config)

    # ------------------------------------------------------------------------------------------------ training

    def start(self, global_step: int) -> contextlib.AbstractContextManager:
        """Begin the loop's clocks (the ETA counts this process's steps only: a resume's start-up is not one); the
        context writes log lines above the progress bars instead of gluing them onto them."""
        self._started = self._last_train_line = time.perf_counter()
        self._start_step = global_step
        self._images_seen = self._images_at_last_line = global_step * self._plan.images_per_step
        self._write_phase("loop_start", 0.0)  # a moment, not a span: the benchmark's epoch section ends start-up here
        return logging_redirect_tqdm()

    @contextlib.contextmanager
    def epoch_bar(self, epoch: int, *, images_done: int) -> Iterator[None]:
        """The bar of ``epoch``, which counts global images (all ranks), the unit users reason in: exactly those the
        epoch trains (with several ranks the sampler pads the epoch to a multiple of the world size), so it ends at
        100%."""
        plan = self._plan
        self._bar = tqdm(
            total=images_done + plan.images_per_rank(images_done) * plan.world_size,
            initial=images_done,
            desc=f"Epoch {epoch + 1}/{self._last_epoch}",
            unit="img",
            disable=not self.bars,
            dynamic_ncols=True,
        )
        try:
            yield
        finally:
            self._bar.close()

    def trained(self, images: int) -> None:
        """Count ``images`` of this rank's micro-batch (every rank trains as many) into the bar and the rate."""
        self._images_seen += images * self.ctx.world_size
        self._bar.update(images * self.ctx.world_size)

    def add_losses(self, losses: torch.Tensor) -> None:
        """Count the steps' ``[loss sum, count]`` into the window and the epoch; on every rank (an all-reduce)."""
        window = sum_across_ranks(self.ctx, losses).tolist()
        self._window = [total + value for total, value in zip(self._window, window, strict=True)]
        self._epoch = [total + value for total, value in zip(self._epoch, window, strict=True)]

    def log_train(self, *, epoch: int, position: TrainPosition, lr: float) -> None:
        """The train line of the window since the previous one (bar, log line, metrics.jsonl, TensorBoard, wandb)."""
        (loss_sum, count), self._window = self._window, [0.0, 0.0]
        loss = loss_sum / count if count else float("nan")
        now, step = time.perf_counter(), position.global_step
        images_per_s = (self._images_seen - self._images_at_last_line) / max(now - self._last_train_line, 1e-9)
        self._last_train_line, self._images_at_last_line = now, self._images_seen
        self._bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)
        if self._log_lines:
            logger.info(
                "epoch %d/%d step %d/%d (global %d): loss %.4f, lr %.2e, %.1f img/s, ETA %s",
                epoch + 1,
                self._last_epoch,
                position.step_in_epoch,
                self._plan.steps_per_epoch,
                step,
                loss,
                lr,
                images_per_s,
                self._eta(epoch, step, position.step_in_epoch),
            )
        self._write(
            {
                "event": "train",
                "epoch": epoch + 1,
                "global_step": step,
                "loss": loss,
                "lr": lr,
                "images_per_s": images_per_s,
                "images_seen": self._images_seen,
                "time": time.time(),
            }
        )
        scalars = {"train loss": ("train/loss", loss), "learning rate": ("train/learning_rate", lr)}
        self._publish(step, {**scalars, "images/s": ("train/images_per_s", images_per_s)})

    def _eta(self, epoch: int, global_step: int, step_in_epoch: int) -> str:
        if global_step <= self._start_step:
            return "?"
        seconds_per_step = (time.perf_counter() - self._started) / (global_step - self._start_step)
        steps_per_epoch = self._plan.steps_per_epoch
        remaining = (self._last_epoch - epoch - 1) * steps_per_epoch + steps_per_epoch - step_in_epoch
        if self._max_steps:
            remaining = min(remaining, self._max_steps - global_step)
        return format_duration(max(remaining, 0) * seconds_per_step)

    def epoch_line(self, *, epoch_number: int, global_step: int) -> None:
        """Log the epoch's mean training loss and its validation (Dice, IoU) if it validated; resets both."""
        (total, count), self._epoch = self._epoch, [0.0, 0.0]
        validation, self._last_validation = self._last_validation, None
        if not self._log_lines:
            return
        mean = f"{total / count:.4f}" if count else "n/a"
        scores = f"; validation Dice {validation[0]:.4f}, IoU {validation[1]:.4f}" if validation else ""
        logger.info(
            "epoch %d/%d done (step %d): mean training loss %s%s", epoch_number, self._last_epoch, global_step, mean,
            scores,
        )  # fmt: skip

    # ---------------------------------------------------------------------------------------------- validation

    def wants_samples(self) -> bool:
        return self._wandb_run is not None or self._tensorboard is not None

    def log_val(self, *, epoch: int, global_step: int, result: EvalResult, samples: dict[str, Any] | None) -> None:
        """``samples``: optional ``image``/``true``/``pred`` tensors (+ ``histograms`` for wandb) of a few images."""
        self._last_validation = (result.dice, result.iou)
        if result.dice == 0 and not self._scored_any_foreground:
            self._scored_any_foreground = True  # said once: the next zeros need no repeat
            logger.info(ZERO_DICE_HINT)
        self._scored_any_foreground |= result.dice > 0
        # The scores as evaluate.py writes them: the headline macro (per-image mean) Dice and IoU, and both reductions
        # (with micro: dataset-level), per class and averaged; see utils.evaluation.
        self._write(
            {"event": "val", "epoch": epoch, "global_step": global_step, **result.as_dict(), "time": time.time()}
        )
        scalars = {"validation Dice": ("val/dice", result.dice), "validation IoU": ("val/iou", result.iou)}
        for index, (dice, iou) in enumerate(zip(result.per_class_dice, result.per_class_iou, strict=True)):
            scalars[f"validation Dice/class {index}"] = (f"val/dice/class_{index}", dice)
            scalars[f"validation IoU/class {index}"] = (f"val/iou/class_{index}", iou)
        self._publish(global_step, scalars, samples, n_classes=len(result.per_class_dice))
        self.draw_curves()  # after every validation, so a long run's curves.png is always current

    # ------------------------------------------------------------------------------------------ files and runs

    def draw_curves(self) -> bool:
        """curves.png from metrics.jsonl (rank 0); False when there was nothing to draw or it could not be written."""
        with self.phase("curves"):
            return self.enabled and write_curves_if_possible(self.run_folder.metrics, self.run_folder.curves)

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

    def _write_phase(self, name: str, seconds: float) -> None:
        self._write({"event": "phase", "phase": name, "seconds": seconds, "time": time.time()})

    def close(self) -> None:
        if not self.enabled:
            return
        self._metrics_file.close()
        if self._tensorboard is not None:
            with contextlib.suppress(OSError):  # a full disk was said by the write that met it
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

    def _publish(self, step: int, scalars: Scalars, samples: dict[str, Any] | None = None, n_classes: int = 2) -> None:
        """``scalars`` and the validation ``samples`` to TensorBoard and wandb, those that are on."""
        if self._tensorboard is not None:
            try:  # a side output: a full or failing disk is one warning, and the run goes on without it
                _write_events(self._tensorboard, step, scalars, samples, n_classes)
            except OSError as error:
                logger.warning(
                    "cannot write TensorBoard events to %s: %s; training continues without --tensorboard",
                    self.run_folder.tensorboard,
                    error.strerror or error,
                )
                with contextlib.suppress(Exception):
                    self._tensorboard.close()
                self._tensorboard = None
        if self._wandb_run is not None:
            try:  # telemetry must never end a training run: on any wandb failure, warn once and continue without it
                self._wandb_run.log(_wandb_record(scalars, samples, n_classes), step=step)
            except Exception as error:
                logger.warning("wandb logging failed (%s); continuing without wandb", error)
                self._wandb_run = None


def _write_events(writer: Any, step: int, scalars: Scalars, samples: dict[str, Any] | None, n_classes: int) -> None:
    for tag, value in scalars.values():
        writer.add_scalar(tag, value, step)
    if samples is not None:
        writer.add_images("val/image", samples["image"].detach().float().cpu().clamp(0, 1), step)
        writer.add_images("val/truth", class_images(samples["true"], n_classes), step)
        writer.add_images("val/prediction", class_images(samples["pred"], n_classes), step)
    writer.flush()  # a write error of the writer's thread surfaces here


def class_images(classes: torch.Tensor, n_classes: int) -> torch.Tensor:
    """Class indices ``[N, H, W]`` (or one ``[H, W]``) as grey ``[N, 1, H, W]`` images in [0, 1], classes spread out
    so that the masks are visible. Void pixels (negative indices) are black like class 0."""
    classes = classes.detach().cpu()
    if classes.dim() == 2:
        classes = classes.unsqueeze(0)
    return (classes.clamp(min=0).float() / (max(n_classes, 2) - 1)).clamp(max=1).unsqueeze(1)


def _wandb_record(scalars: Scalars, samples: dict[str, Any] | None, n_classes: int) -> dict[str, Any]:
    import wandb

    record: dict[str, Any] = {name: value for name, (_, value) in scalars.items()}
    if samples is not None:
        # The first of the samples (TensorBoard shows them all).
        record["images"] = wandb.Image(samples["image"][0].float().cpu().permute(1, 2, 0).numpy())
        masks = {name: class_images(samples[name][0], n_classes)[0, 0] for name in ("true", "pred")}
        record["masks"] = {name: wandb.Image((mask * 255).byte().numpy()) for name, mask in masks.items()}
        for name, values in samples.get("histograms", {}).items():
            record[name] = wandb.Histogram(values.float().cpu())
    return record


def _start_tensorboard(run_folder: RunFolder, resumed_step: int | None) -> Any:
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard needs the tensorboard package: pip install tensorboard, or drop --tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    try:
        folder = side_output_folder(run_folder.tensorboard, "--tensorboard")
    except OutputError as error:
        logger.warning("%s; training continues without TensorBoard events", error)
        return None
    _quiet_event_writer_threads()
    purge_step = None if resumed_step is None else resumed_step + 1
    try:
        return SummaryWriter(log_dir=str(folder), purge_step=purge_step)
    except OSError as error:
        logger.warning("cannot write TensorBoard events to %s: %s; training continues without them", folder, error)
        return None


def _quiet_event_writer_threads() -> None:
    """TensorBoard's writer thread re-raises its write error (a full disk) as a traceback on stderr, and the main
    thread meets the same error at its next flush (one warning, ``RunLog._publish``): the traceback goes to debug."""
    if getattr(threading.excepthook, "_quiets_event_writers", False):
        return
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            logger.debug("TensorBoard's writer thread failed", exc_info=(args.exc_type, args.exc_value, None))
            return
        previous(args)

    hook._quiets_event_writers = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def _start_wandb(run_folder: RunFolder, config: TrainConfig) -> Any:
    try:
        import wandb
    except ImportError:
        logger.warning(
            "--wandb %s but wandb is not installed; continuing without it (pip install wandb)", config.logging.wandb
        )
        return None
    try:
        return wandb.init(
            project=WANDB_PROJECT,
            name=config.checkpoint.exp_name,
            config=config.as_dict(),
            mode=config.logging.wandb,
            dir=str(run_folder.path),
        )
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
