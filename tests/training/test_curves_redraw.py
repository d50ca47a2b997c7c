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
