"""What a run tells while it trains: progress bars or log lines, ``metrics.jsonl``, TensorBoard, wandb and curves.png.

Only global rank 0 writes or draws anything; other ranks log errors only, and take part in the one collective of
logging (the all-reduce of the losses, in ``_mean_loss``). Log lines go to stdout so that stderr carries progress bars
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
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, TextIO

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from utils.cli import stderr_is_terminal
from utils.errors import ConfigError, count
from utils.evaluation import EvalResult, predict_classes
from utils.launch.process_group import DistributedContext, sum_across_ranks
from utils.output_files import OutputError, open_for_append, side_output_folder
from utils.training.config_file import write_config_file
from utils.training.curves import write_curves_if_possible

if TYPE_CHECKING:
    from utils.training.parts import TrainParts

logger = logging.getLogger(__name__)

WANDB_PROJECT = "U-Net"
SAMPLE_IMAGES = 4  # validation images (with true and predicted masks) shown per validation
# curves.png is drawn again after a validation at most this often (a draw costs 0.2-0.4 s of CPU: a run of short
# epochs would spend a large part of its time drawing), and once more at the end of the run.
CURVES_EVERY_S = 60.0

ZERO_DICE_HINT = (
    "Dice 0.0000 in the first validations is expected: a model early in training predicts no foreground pixel at "
    "all; it rises once the model starts to find the objects"
)
SCALARS = {
    "loss": ("train/loss", "train loss"),
    "lr": ("train/learning_rate", "learning rate"),
    "images_per_s": ("train/images_per_s", "images/s"),
    "dice": ("val/dice", "validation Dice"),
    "iou": ("val/iou", "validation IoU"),
    "per_class_dice": ("val/dice/class_{}", "validation Dice/class {}"),
    "per_class_iou": ("val/iou/class_{}", "validation IoU/class {}"),
}
"""The scores of a metrics.jsonl record that TensorBoard and wandb show: its key -> (TensorBoard tag, wandb name). A
list (per class) is one score per class, numbered in both names."""


class SideOutput(NamedTuple):
    """TensorBoard or wandb, as the run's log writes to it: ``write(scalars, samples, step)`` with a record's scores
    (TensorBoard tag -> (wandb name, value)) and a validation's samples (else None)."""

    flag: str
    failure: str
    """What a failure to write means, the start of its one warning."""
    write: Callable[[dict[str, tuple[str, float]], dict[str, Any] | None, int], None]
    close: Callable[[], object]


def bars_wanted(*, is_main: bool, no_progress: bool, stream: TextIO | None = None) -> bool:
    """Progress bars only on global rank 0, on a terminal, and unless ``--no-progress``."""
    return is_main and not no_progress and stderr_is_terminal(stream)


class RunLog:
    """The run's settings, progress, metrics and curves, of ``parts``: its flags (the logging section, and the epoch
    plan: a resumed run's is its checkpoint's), folder, batch plan, and position, which every record reports.

    Opening it says the run's summary line and changed settings and writes the run's resolved flags (those its
    checkpoints store) to config.yaml; a run folder it cannot write to is a ConfigError."""

    def __init__(self, ctx: DistributedContext, parts: TrainParts) -> None:
        config = parts.config
        self.ctx = ctx
        self.parts = parts
        self.run_folder = run_folder = parts.run_folder
        self.bars = bars_wanted(is_main=ctx.is_main, no_progress=config.logging.no_progress)
        self._log_lines = ctx.is_main and not self.bars
        self._first_epoch, self._last_epoch = config.epoch_range()
        # Losses summed over ranks as [sum, count]: since the last train line (a window may span an epoch's end), and
        # of this epoch (for the epoch line's mean).
        self._losses = {"line": [0.0, 0.0], "epoch": [0.0, 0.0]}
        self._last_validation: EvalResult | None = None
        self._zero_dice_explained = False
        self._curves_current = False  # whether curves.png shows every record of metrics.jsonl already
        self._curves_due = time.monotonic() + CURVES_EVERY_S  # when a validation may draw them again
        self._side_outputs: list[SideOutput] = []  # rank 0's (below)
        # The run's summary: ``Starting training: epochs 1..6, ...``, or for a resumed run where in its plan it goes on
        plan, position = parts.batch_plan, parts.position
        done = f"step {position.global_step} ({position.step_in_epoch} batches of the epoch done)"
        start = f"Resuming at epoch {position.epoch + 1}, {done} of" if parts.resumed else "Starting training:"
        logger.info(
            f"{start} epochs {self._first_epoch}..{self._last_epoch}, batch size {plan.batch_size} per process x "
            f"{count(plan.world_size, 'process', 'processes')} x {plan.grad_accum} accumulation = "
            f"{plan.images_per_step}, learning rate {config.optimisation.learning_rate:g}, "
            f"{len(parts.data.train_set)} training / {len(parts.data.val_set)} validation images, scale "
            f"{config.data.scale:g}, precision {parts.step.precision}, device {ctx.device}, "
            f"{count(torch.get_num_threads(), 'CPU thread')} and "
            f"{count(parts.loaders.train.num_workers, 'loader worker')} per process, run folder {run_folder}"
        )
        settings = config.settings_block()
        logger.info("%s", settings)
        if not ctx.is_main:
            return
        try:
            write_config_file(run_folder.config_file, parts.run_args, settings)
            # Appending keeps the history of a resumed run in the same file; the curves keep the last value per step.
            # A torn last line (a crash mid-write) is dropped first, so it cannot swallow the next record.
            self._metrics_file = open_for_append(run_folder.metrics)
        except OSError as error:
            raise ConfigError(
                f"cannot write to the run folder {run_folder}: {error.strerror or error}; choose a writable "
                f"--checkpoint-dir"
            ) from error
        tensorboard = _start_tensorboard(parts) if config.logging.tensorboard else None
        wandb_run = _start_wandb(parts) if config.logging.wandb != "disabled" else None
        self._side_outputs = [output for output in (tensorboard, wandb_run) if output is not None]

    # ------------------------------------------------------------------------------------------------ training

    def start(self) -> contextlib.AbstractContextManager:
        """Begin the loop's clocks (the ETA counts this process's steps only: a resume's start-up is not one); the
        context writes log lines above the progress bars instead of gluing them onto them."""
        self._started = self._last_train_line = time.perf_counter()
        self._start_step = step = self.parts.position.global_step
        self._images_seen = self._images_at_last_line = step * self.parts.batch_plan.images_per_step
        self._write("phase", {"phase": "loop_start", "seconds": 0.0})  # a moment, not a span: see ``phase``
        return logging_redirect_tqdm()

    def epoch_bar(self, epoch: int, *, images_done: int) -> tqdm:
        """The bar of ``epoch`` (a context: closed at its end), which counts global images (all ranks), the unit users
        reason in: exactly those the epoch trains (with several ranks the sampler pads the epoch to a multiple of the
        world size), so it ends at 100%."""
        plan = self.parts.batch_plan
        self._bar = tqdm(
            total=images_done + plan.images_per_rank(images_done) * plan.world_size,
            initial=images_done,
            desc=f"Epoch {epoch + 1}/{self._last_epoch}",
            unit="img",
            disable=not self.bars,
            dynamic_ncols=True,
        )
        return self._bar

    def trained(self, images: int) -> None:
        """Count ``images`` of this rank's micro-batch (every rank trains as many) into the bar and the rate."""
        self._images_seen += images * self.ctx.world_size
        self._bar.update(images * self.ctx.world_size)

    def _mean_loss(self, window: str) -> float:
        """The mean loss of ``window`` (``line``: since the last train line; ``epoch``: of this epoch), which starts
        again; NaN when it holds none. On every rank: it counts the step's losses since the last read into both (an
        all-reduce)."""
        losses = sum_across_ranks(self.ctx, self.parts.step.take_losses()).tolist()
        for totals in self._losses.values():
            totals[:] = [total + value for total, value in zip(totals, losses, strict=True)]
        (total, count), self._losses[window] = self._losses[window], [0.0, 0.0]
        return total / count if count else float("nan")

    def log_train(self) -> None:
        """The train line of the window since the previous one (bar, log line, metrics.jsonl, TensorBoard, wandb); on
        every rank (the losses' all-reduce)."""
        loss, lr = self._mean_loss("line"), self.parts.step.optimizer.param_groups[0]["lr"]
        now, position = time.perf_counter(), self.parts.position
        images_per_s = (self._images_seen - self._images_at_last_line) / max(now - self._last_train_line, 1e-9)
        self._last_train_line, self._images_at_last_line = now, self._images_seen
        self._bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)
        if self._log_lines:
            logger.info(
                f"epoch {position.epoch + 1}/{self._last_epoch} step {position.step_in_epoch}/"
                f"{self.parts.batch_plan.steps_per_epoch} (global {position.global_step}): loss {loss:.4f}, "
                f"lr {lr:.2e}, {images_per_s:.1f} img/s, ETA {self._eta()}"
            )
        record = {"epoch": position.epoch + 1, "global_step": position.global_step, "loss": loss, "lr": lr}
        self._write("train", {**record, "images_per_s": images_per_s, "images_seen": self._images_seen})

    def _eta(self) -> str:
        position, steps_per_epoch = self.parts.position, self.parts.batch_plan.steps_per_epoch
        if position.global_step <= self._start_step:
            return "?"
        seconds_per_step = (time.perf_counter() - self._started) / (position.global_step - self._start_step)
        remaining = (self._last_epoch - position.epoch) * steps_per_epoch - position.step_in_epoch
        if max_steps := self.parts.config.optimisation.max_steps:
            remaining = min(remaining, max_steps - position.global_step)
        return tqdm.format_interval(max(remaining, 0) * seconds_per_step)  # 2:03:04, or 03:04 below an hour

    def epoch_line(self) -> None:
        """Log the epoch's mean training loss and its validation (Dice, IoU) if it validated; resets both. On every
        rank: it reads the epoch's remaining losses (an all-reduce), whether or not it logs."""
        loss = self._mean_loss("epoch")
        validation, self._last_validation = self._last_validation, None
        if not self._log_lines:
            return
        mean = "n/a" if math.isnan(loss) else f"{loss:.4f}"
        scores = f"; validation Dice {validation.dice:.4f}, IoU {validation.iou:.4f}" if validation else ""
        position = self.parts.position
        logger.info(
            f"epoch {position.epoch}/{self._last_epoch} done (step {position.global_step}): mean training loss "
            f"{mean}{scores}"
        )

    # ---------------------------------------------------------------------------------------------- validation

    def log_val(self, result: EvalResult) -> None:
        """The validation at the position's epoch end (rank 0): its line, its record, a few of its images for
        TensorBoard and wandb, and curves.png."""
        position, micro = self.parts.position, result.reductions()["micro"]
        per_class = ", ".join(
            f"{k}: Dice {dice:.4f} IoU {iou:.4f}"
            for k, (dice, iou) in enumerate(zip(result.per_class_dice, result.per_class_iou, strict=True))
        )
        logger.info(
            f"Validation after epoch {position.epoch} (step {position.global_step}, {count(result.n_images, 'image')}"
            f"): Dice {result.dice:.4f}, IoU {result.iou:.4f} [{per_class}] (macro: per-image means; the means "
            f"average classes 1+); micro (dataset-level) Dice {micro['dice']:.4f}, IoU {micro['iou']:.4f}"
        )
        self._last_validation = result
        if result.dice == 0 and not self._zero_dice_explained:
            logger.info(ZERO_DICE_HINT)
        self._zero_dice_explained |= result.dice >= 0  # said once, and never after a foreground was found
        # The scores as evaluate.py writes them: the headline macro (per-image mean) Dice and IoU, and both reductions
        # (with micro: dataset-level), per class and averaged; see utils.evaluation.
        record = {"epoch": position.epoch, "global_step": position.global_step, **result.as_dict()}
        self._write("val", record, self._samples(len(result.per_class_dice)) if self._side_outputs else None)
        if time.monotonic() >= self._curves_due:  # so that a long run's curves.png is at most a minute behind
            self.draw_curves()

    @torch.inference_mode()
    def _samples(self, n_classes: int) -> dict[str, torch.Tensor]:
        """A few validation images with their true and predicted masks (grey images, classes spread out over [0, 1]
        so that they are visible; void pixels black like class 0)."""
        model, batch = self.parts.evaluated_model, next(iter(self.parts.loaders.val))
        images = batch["image"][:SAMPLE_IMAGES]
        model.eval()
        try:
            logits = model(images.to(self.ctx.device))
        finally:
            model.train()
        masks = {"true": batch["mask"][:SAMPLE_IMAGES], "pred": predict_classes(logits)}
        samples = {
            name: (classes.cpu().clamp(min=0).float() / max(n_classes - 1, 1)).clamp(max=1).unsqueeze(1)
            for name, classes in masks.items()
        }
        return {"image": images.float().clamp(0, 1), **samples}

    # ------------------------------------------------------------------------------------------ files and runs

    def draw_curves(self) -> bool:
        """curves.png from metrics.jsonl (rank 0), unless it shows every record already; False when there was nothing
        to draw or it could not be written."""
        with self.phase("curves"):
            if self.ctx.is_main and not self._curves_current:
                self._curves_current = write_curves_if_possible(self.run_folder.metrics, self.run_folder.curves)
                self._curves_due = time.monotonic() + CURVES_EVERY_S
            return self._curves_current

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
            self._write("phase", {"phase": name, "seconds": time.perf_counter() - started})

    def close(self) -> None:
        if not self.ctx.is_main:
            return
        self._metrics_file.close()
        for output in self._side_outputs:
            with contextlib.suppress(OSError):  # a full disk was said by the write that met it
                output.close()

    def _write(self, event: str, fields: dict[str, Any], samples: dict[str, Any] | None = None) -> None:
        """One record of metrics.jsonl (rank 0); a train or val record's scores go to TensorBoard and wandb too, at its
        step, with a validation's ``samples``."""
        if not self.ctx.is_main:
            return
        # One complete line per event, flushed, so a reader polling the file (or a crash) never sees half a record.
        self._metrics_file.write(json.dumps({"event": event, **fields, "time": time.time()}) + "\n")
        self._metrics_file.flush()
        if event == "phase":
            return
        self._curves_current = False
        scalars = {}  # TensorBoard tag -> (wandb name, value)
        for key, (tag, name) in SCALARS.items():
            if isinstance(fields.get(key), list):
                scalars |= {tag.format(k): (name.format(k), value) for k, value in enumerate(fields[key])}
            elif key in fields:
                scalars[tag] = (name, fields[key])
        for output in list(self._side_outputs):
            try:  # telemetry must never end a training run: a full disk, wandb's network... are one warning each
                output.write(scalars, samples, fields["global_step"])
            except Exception as error:
                reason = getattr(error, "strerror", None) or error
                logger.warning(f"{output.failure}: {reason}; training continues without {output.flag}")
                self._side_outputs.remove(output)
                with contextlib.suppress(Exception):
                    output.close()


def _start_tensorboard(parts: TrainParts) -> SideOutput | None:
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard needs the tensorboard package: pip install tensorboard, or drop --tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    _quiet_event_writer_threads()
    try:
        folder = side_output_folder(parts.run_folder.tensorboard, "--tensorboard")
        # A resumed run hides what the run it continues logged after its checkpoint: see the module's docstring.
        writer = SummaryWriter(
            log_dir=str(folder), purge_step=parts.position.global_step + 1 if parts.resumed else None
        )
    except (OutputError, OSError) as error:  # the folder refused (a link, a file), or a full disk already
        logger.warning("%s; training continues without --tensorboard", error)
        return None

    def write(scalars: dict[str, tuple[str, float]], samples: dict[str, Any] | None, step: int) -> None:
        for tag, (_, value) in scalars.items():
            writer.add_scalar(tag, value, step)
        if samples is not None:
            for tag, name in (("val/image", "image"), ("val/truth", "true"), ("val/prediction", "pred")):
                writer.add_images(tag, samples[name], step)
        writer.flush()  # a write error of the writer's thread surfaces here

    return SideOutput("--tensorboard", f"cannot write TensorBoard events to {folder}", write, writer.close)


def _quiet_event_writer_threads() -> None:
    """TensorBoard's writer thread re-raises its write error (a full disk) as a traceback on stderr, and the main
    thread meets the same error at its next flush (one warning, ``RunLog._write``): the traceback goes to debug."""
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


def _start_wandb(parts: TrainParts) -> SideOutput | None:
    mode = parts.config.logging.wandb
    try:
        import wandb

        run = wandb.init(
            project=WANDB_PROJECT,
            name=parts.config.checkpoint.exp_name,
            config=parts.run_args,
            mode=mode,
            dir=str(parts.run_folder.path),
        )
    except Exception as error:  # not installed, or any of wandb's failures (network, login): none should stop training
        fix = " (pip install wandb)" if isinstance(error, ImportError) else ""
        logger.warning("--wandb %s: wandb could not start (%s); continuing without it%s", mode, error, fix)
        return None

    def write(scalars: dict[str, tuple[str, float]], samples: dict[str, Any] | None, step: int) -> None:
        record: dict[str, Any] = dict(scalars.values())
        if samples is not None:
            # The first of the samples (TensorBoard shows them all), and the evaluated model's weight and gradient
            # histograms (the finite ones).
            record["images"] = wandb.Image(samples["image"][0].permute(1, 2, 0).numpy())
            record["masks"] = {
                name: wandb.Image((samples[name][0, 0] * 255).byte().numpy()) for name in ("true", "pred")
            }
            for name, parameter in parts.evaluated_model.named_parameters():
                for kind, values in (("Weights", parameter), ("Gradients", parameter.grad)):
                    if values is not None and torch.isfinite(values).all():
                        record[f"{kind}/{name.replace('/', '.')}"] = wandb.Histogram(values.detach().float().cpu())
        run.log(record, step=step)

    return SideOutput("--wandb", "wandb logging failed", write, run.finish)
