"""curves.png is drawn again only when the curves changed (drawing costs the training process about half a second)."""

from __future__ import annotations

import json
from pathlib import Path

from utils.training.curves import drawn_digest, read_series, series_digest, write_curves_if_possible


def _append(path: Path, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")


def test_the_same_curves_are_not_drawn_twice_and_new_ones_are(tmp_path: Path) -> None:
    metrics, png = tmp_path / "metrics.jsonl", tmp_path / "curves.png"
    for step in (1, 2):
        record = {"event": "train", "epoch": 0, "global_step": step, "loss": 1.0 / step, "images_seen": 2 * step}
        _append(metrics, {**record, "lr": 1e-3, "images_per_s": 3.0, "time": 100.0 + step})
    assert write_curves_if_possible(metrics, png)
    first = png.stat()
    assert drawn_digest(png) == series_digest(read_series(metrics))

    # A record the figure does not show (the trainer's phase timings) changes nothing: the file stays as it was.
    _append(metrics, {"event": "phase", "phase": "checkpoint", "seconds": 0.1, "time": 104.0})
    assert write_curves_if_possible(metrics, png)
    assert (png.stat().st_ino, png.stat().st_mtime_ns) == (first.st_ino, first.st_mtime_ns)

    _append(metrics, {"event": "val", "epoch": 1, "global_step": 2, "dice": 0.5, "per_class_dice": [0.9, 0.5]})
    assert write_curves_if_possible(metrics, png)
    assert png.stat().st_ino != first.st_ino, "a new validation is drawn (an atomic replace: a new file)"
    assert drawn_digest(png) == series_digest(read_series(metrics)) != drawn_digest(tmp_path / "missing.png")


def test_a_figure_without_a_digest_is_redrawn(tmp_path: Path) -> None:
    from PIL import Image

    metrics, png = tmp_path / "metrics.jsonl", tmp_path / "curves.png"
    _append(metrics, {"event": "train", "epoch": 0, "global_step": 1, "loss": 1.0, "images_seen": 2, "time": 1.0})
    Image.new("RGB", (4, 4)).save(png)  # an older version's figure, or any other PNG
    assert drawn_digest(png) is None
    assert write_curves_if_possible(metrics, png)
    assert drawn_digest(png) == series_digest(read_series(metrics))


def _dice_legend(metrics: Path) -> list[str]:
    from utils.training.curves import build_figure

    dice_axes = next(axes for axes in build_figure(read_series(metrics)).axes if axes.get_title() == "Validation Dice")
    return [text.get_text() for text in dice_axes.get_legend().get_texts()]


def test_a_binary_task_draws_its_one_foreground_class_as_the_mean_not_hidden_under_it(tmp_path: Path) -> None:
    binary, three = tmp_path / "binary.jsonl", tmp_path / "three.jsonl"
    for step, (background, car) in enumerate([(0.9, 0.5), (0.95, 0.7)], start=1):
        _append(binary, {"event": "val", "epoch": step, "global_step": step, "dice": car,
                         "per_class_dice": [background, car]})  # fmt: skip
        _append(three, {"event": "val", "epoch": step, "global_step": step, "dice": (car + 0.3) / 2,
                        "per_class_dice": [background, car, 0.3]})  # fmt: skip
    assert _dice_legend(binary) == ["class 0", "mean (foreground) = class 1"]
    assert _dice_legend(three) == ["class 0", "class 1", "class 2", "mean (foreground)"]
