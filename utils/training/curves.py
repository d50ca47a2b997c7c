"""``curves.png``: training loss and validation Dice per optimizer step, drawn from metrics.jsonl with Pillow."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from PIL import Image, ImageDraw

PANEL_SIZE = (480, 320)
MARGIN = (56, 24, 16, 40)  # left, top, right, bottom
BACKGROUND = (255, 255, 255)
AXIS = (60, 60, 60)
GRID = (225, 225, 225)
LOSS_COLOUR = (31, 119, 180)
DICE_COLOUR = (214, 39, 40)


def read_series(metrics_path: Path) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(global_step, loss) and (global_step, dice) points; a step logged twice (a resumed run) keeps its last value."""
    losses: dict[int, float] = {}
    dices: dict[int, float] = {}
    with open(metrics_path, encoding="utf-8") as handle:
        for line in handle:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            if event.get("event") == "train":
                losses[int(event["global_step"])] = float(event["loss"])
            elif event.get("event") == "val":
                dices[int(event["global_step"])] = float(event["dice"])
    return sorted(losses.items()), sorted(dices.items())


def draw_curves(metrics_path: Path, out_path: Path) -> None:
    """Two panels side by side: training loss, validation Dice."""
    losses, dices = read_series(metrics_path)
    width, height = PANEL_SIZE
    image = Image.new("RGB", (2 * width, height), BACKGROUND)
    draw = ImageDraw.Draw(image)
    _panel(draw, (0, 0), "training loss", losses, LOSS_COLOUR)
    _panel(draw, (width, 0), "validation Dice", dices, DICE_COLOUR)
    image.save(out_path)


def _panel(
    draw: ImageDraw.ImageDraw,
    origin: tuple[int, int],
    title: str,
    points: Sequence[tuple[float, float]],
    colour: tuple[int, int, int],
) -> None:
    left, top, right, bottom = MARGIN
    x0, y0 = origin[0] + left, origin[1] + top
    x1, y1 = origin[0] + PANEL_SIZE[0] - right, origin[1] + PANEL_SIZE[1] - bottom
    draw.text((x0, origin[1] + 6), title, fill=AXIS)
    draw.rectangle((x0, y0, x1, y1), outline=AXIS)
    if not points:
        draw.text((x0 + 8, y0 + 8), "no data yet", fill=AXIS)
        return
    steps = [step for step, _ in points]
    values = [value for _, value in points if math.isfinite(value)] or [0.0]
    step_lo, step_hi = min(steps), max(steps)
    value_lo, value_hi = min(values), max(values)
    if value_hi == value_lo:
        value_lo, value_hi = value_lo - 0.5, value_hi + 0.5
    if step_hi == step_lo:
        step_lo, step_hi = step_lo - 1, step_hi + 1

    def to_pixel(step: float, value: float) -> tuple[float, float]:
        fx = (step - step_lo) / (step_hi - step_lo)
        fy = (value - value_lo) / (value_hi - value_lo)
        return x0 + fx * (x1 - x0), y1 - fy * (y1 - y0)

    for fraction in (0.25, 0.5, 0.75):
        y = y1 - fraction * (y1 - y0)
        draw.line((x0 + 1, y, x1 - 1, y), fill=GRID)
    for value, y in ((value_hi, y0), (value_lo, y1)):
        draw.text((origin[0] + 4, y - 6), f"{value:.3g}", fill=AXIS)
    draw.text((x0, y1 + 6), f"step {step_lo:g}", fill=AXIS)
    label = f"step {step_hi:g}"
    draw.text((x1 - 6 * len(label), y1 + 6), label, fill=AXIS)

    pixels = [to_pixel(step, value) for step, value in points if math.isfinite(value)]
    if len(pixels) > 1:
        draw.line(pixels, fill=colour, width=2)
    for x, y in pixels if len(pixels) <= 50 else pixels[-1:]:
        draw.ellipse((x - 2, y - 2, x + 2, y + 2), fill=colour)


def write_curves_if_possible(metrics_path: Path, out_path: Path) -> bool:
    """Draw the curves when metrics exist; False when there is nothing to draw yet."""
    if not metrics_path.exists():
        return False
    draw_curves(metrics_path, out_path)
    return True
