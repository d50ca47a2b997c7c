"""``curves.png``: the history of a run from ``metrics.jsonl``, drawn headless with matplotlib.

Like nnU-Net's progress.png, five panels with labelled axes: training loss, validation Dice (mean of the foreground
classes and each class), learning rate, throughput, and the time of each epoch's training steps. The figure is drawn
on matplotlib's Agg canvas directly (no pyplot, no window, no global backend switch), so it works on machines without
a display and inside any process. A resumed run appends to the same ``metrics.jsonl``; a step logged twice keeps its
last value, so the curves of a resumed run continue as one line.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from utils.output_files import OutputError, write_file

if TYPE_CHECKING:
    from matplotlib.figure import Figure

logger = logging.getLogger(__name__)

Points = list[tuple[float, float]]


@dataclass
class Series:
    """The curves of one run, each as sorted ``(x, value)`` points."""

    loss: Points = field(default_factory=list)
    """(global step, mean training loss since the previous log)."""
    learning_rate: Points = field(default_factory=list)
    images_per_s: Points = field(default_factory=list)
    dice: Points = field(default_factory=list)
    """(global step, validation Dice averaged over the foreground classes)."""
    per_class_dice: dict[int, Points] = field(default_factory=dict)
    epoch_seconds: Points = field(default_factory=list)
    """(epoch, seconds its optimizer steps took), estimated from the step times logged in that epoch."""


def read_series(metrics_path: Path) -> Series:
    """The curves in ``metrics_path``; lines cut short by a crash (see ``output_files.open_for_append``) are skipped."""
    latest: dict[tuple[str, int], dict] = {}  # (event, global step) -> its last record
    with open(metrics_path, encoding="utf-8") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            # A torn line can still parse (as a number, say).
            if isinstance(record, dict) and record.get("event") in ("train", "val"):
                latest[record["event"], int(record["global_step"])] = record
    series = Series()
    for (event, step), record in sorted(latest.items()):
        if event == "val":
            series.dice.append((step, float(record["dice"])))
            for index, dice in enumerate(record.get("per_class_dice") or []):
                series.per_class_dice.setdefault(index, []).append((step, float(dice)))
            continue
        series.loss.append((step, float(record["loss"])))
        for key, points in (("lr", series.learning_rate), ("images_per_s", series.images_per_s)):
            if key in record:
                points.append((step, float(record[key])))
    series.epoch_seconds = _epoch_seconds([record for (event, _), record in sorted(latest.items()) if event == "train"])
    return series


def _epoch_seconds(events: list[dict]) -> Points:
    """Seconds per epoch: the median time per optimizer step between consecutive logs, times the epoch's steps.

    The median ignores the gap of an interruption (a resumed epoch's logs straddle the downtime) and the validation
    pauses between epochs, so the figure is the training time an uninterrupted epoch takes. An epoch's steps are
    counted from the previous epoch's last log to its own last log (from its first log, plus one logging interval,
    when the previous epoch is not in the file).
    """
    by_epoch: dict[int, list[dict]] = defaultdict(list)
    for event in events:
        if "time" in event and "epoch" in event:
            by_epoch[int(event["epoch"])].append(event)
    points: Points = []
    for epoch, logged in sorted(by_epoch.items()):
        gaps = [
            (later["time"] - earlier["time"], later["global_step"] - earlier["global_step"])
            for earlier, later in zip(logged, logged[1:], strict=False)
            if later["global_step"] > earlier["global_step"]
        ]
        if not gaps:
            continue
        interval = statistics.median(n for _, n in gaps)  # steps between two logs
        previous = by_epoch.get(epoch - 1)
        start = previous[-1]["global_step"] if previous else logged[0]["global_step"] - interval
        seconds_per_step = statistics.median(seconds / n for seconds, n in gaps)
        points.append((epoch, seconds_per_step * (logged[-1]["global_step"] - start)))
    return points


def build_figure(series: Series) -> Figure:
    """The five panels of ``series``."""
    # Imported here: matplotlib takes about a second to import, which train.py --help or predict.py should not pay.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    # Fixed margins, wide enough for six-character tick labels and an axis label between the panels (matplotlib
    # writes longer numbers with an offset or exponent above the axis): the "constrained" layout fitted them to the
    # labels, at 0.6 s of CPU per draw against 0.37 s (five panels of 400 steps), paid at every run's end.
    figure = Figure(figsize=(14.0, 8.0), dpi=80)
    grid = figure.add_gridspec(2, 6, left=0.055, right=0.99, bottom=0.07, top=0.96, wspace=0.5, hspace=0.28)

    def panel(where, title: str, y_label: str, x_label: str = "optimizer step"):
        axes = figure.add_subplot(where)
        axes.set(title=title, xlabel=x_label, ylabel=y_label)
        axes.grid(True, alpha=0.3)
        return axes

    _plot(panel(grid[0, :3], "Training loss", "loss"), series.loss, "training loss", "#1f77b4")
    dice_axes = panel(grid[0, 3:], "Validation Dice", "validation Dice")
    # A class whose line is the foreground mean at every point (the one foreground class of a binary task) would hide
    # under the mean's line: the mean's label names it instead.
    mean_label = "mean (foreground)"
    for index, points in sorted(series.per_class_dice.items()):
        if points == series.dice:
            mean_label += f" = class {index}"
        else:
            _plot(dice_axes, points, f"class {index}", None, alpha=0.6, linestyle="--")
    _plot(dice_axes, series.dice, mean_label, "#d62728")
    if series.dice or series.per_class_dice:
        dice_axes.legend(loc="lower right", fontsize="small")
    _plot(panel(grid[1, :2], "Learning rate", "learning rate"), series.learning_rate, "learning rate", "#2ca02c")
    _plot(panel(grid[1, 2:4], "Throughput", "images/s (all processes)"), series.images_per_s, "images/s", "#9467bd")
    epoch_axes = panel(grid[1, 4:], "Training time per epoch", "seconds", x_label="epoch")
    _plot(epoch_axes, series.epoch_seconds, "epoch time", "#8c564b")
    epoch_axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
    return figure


def _plot(axes, points: Points, label: str, colour: str | None, *, alpha: float = 1.0, linestyle: str = "-") -> None:
    finite = [(x, y) for x, y in points if math.isfinite(y)]
    if not finite:
        axes.text(0.5, 0.5, "no data yet", transform=axes.transAxes, ha="center", va="center", color="grey")
        return
    xs, ys = zip(*finite, strict=True)
    # A marker on every point keeps a one-epoch run (one validation) visible.
    marker = "o" if len(finite) <= 50 else None
    axes.plot(xs, ys, label=label, color=colour, alpha=alpha, linestyle=linestyle, marker=marker, markersize=4)


def write_curves_if_possible(metrics_path: Path, out_path: Path) -> bool:
    """Write the curves of ``metrics_path`` to ``out_path`` (PNG), all or nothing (``utils.output_files``): a viewer
    never sees half a file, and a failed write leaves the previous figure. False when there is nothing to draw yet or
    the figure could not be written (a warning: the figure is a view of metrics.jsonl, and must not end a training
    run)."""
    if not metrics_path.exists():
        return False
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure = build_figure(read_series(metrics_path))
    try:
        write_file(out_path, lambda temporary: FigureCanvasAgg(figure).print_png(str(temporary)), "the curves")
    except OutputError as error:
        logger.warning("%s; training continues without updating it", error)
        return False
    return True
