"""Carvana-style demo data, so the trainer can be tried without downloading anything.

    python -m utils.datasets.synthetic data/ --n 200 --size 480x320 --seed 0            # binary, Carvana's layout
    python -m utils.datasets.synthetic data/ --n 200 --size 480x320 --classes 4         # multiclass

Binary data uses Carvana's layout exactly: ``imgs/<id>_<nn>.jpg`` and ``masks/<id>_<nn>_mask.gif`` (palette GIF,
indices 0 = background, 1 = car), ``<id>`` 12 hex digits per car and ``<nn>`` 01..16 its views; train on it with
``CarvanaDataset``. ``--views V`` gives each car V views instead (``<id>_01`` .. ``<id>_<V>``; e.g. 48 images of 12
cars with ``--n 48 --views 4``), for trying group-aware splits. Multiclass data writes ``imgs/<id>_<nn>.jpg`` and
``masks/<id>_<nn>.png`` (no mask suffix, 8-bit grey class indices; train with ``BasicDataset``): 0 background, 1 car
body, 2 wheels, 3 windows, and from 4 on one kind of floor object per class (cone, box, ball; each class its own
colour).

The same arguments always give byte-identical files. Existing non-empty folders are only replaced with ``force``.
"""

from __future__ import annotations

import argparse
import colorsys
import logging
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from utils.cli import parse_size, print_error
from utils.datasets.image_files import split_name
from utils.errors import USER_ERROR_EXIT_CODE, ConfigError, DatasetError, UserError

logger = logging.getLogger(__name__)

DEFAULT_SIZE = (480, 320)
VIEWS_PER_CAR = 16
ID_BYTES = 6  # 12 hex digits, as Carvana's ids
MIN_SIDE = 16
MAX_CLASSES = 255  # masks are 8-bit PNGs
JPEG_QUALITY = 90

BACKGROUND, BODY, WHEELS, WINDOWS = 0, 1, 2, 3
FIRST_OBJECT_CLASS = 4
_OBJECT_KINDS = ("cone", "box", "ball")


@dataclass(frozen=True)
class _Part:
    """One filled shape of the scene: a polygon (list of points) or an ellipse (bounding box)."""

    kind: str  # "polygon" or "ellipse"
    points: tuple
    colour: tuple[int, int, int]
    label: int


def generate_carvana_like(
    out_dir: str | Path,
    n: int,
    size: tuple[int, int] = DEFAULT_SIZE,
    seed: int = 0,
    *,
    force: bool = False,
    views: int = VIEWS_PER_CAR,
    n_classes: int | None = None,
) -> list[str]:
    """Write ``n`` images and palette-GIF masks in Carvana's layout under ``out_dir``; return the image ids in order.

    ``views``: images per car (ids ``<car>_01`` .. ``<car>_<views>``), 16 as in Carvana. ``n_classes`` (3 or more):
    grey PNG class-index masks (values 0..n_classes-1) named ``<id>.png`` instead.
    """
    out_dir = Path(out_dir)
    if n_classes is not None and not 3 <= n_classes <= MAX_CLASSES:
        raise ConfigError(f"--classes must be between 3 and {MAX_CLASSES}, got {n_classes}; omit it for binary data")
    width, height = size
    if n < 1:
        raise ConfigError(f"--n must be at least 1, got {n}")
    if not 1 <= views <= 99:
        raise ConfigError(f"--views must be between 1 and 99, got {views}")
    if width < MIN_SIDE or height < MIN_SIDE:
        raise ConfigError(f"--size must be at least {MIN_SIDE}x{MIN_SIDE}, got {width}x{height}")
    images_dir, masks_dir = out_dir / "imgs", out_dir / "masks"
    for folder in (images_dir, masks_dir):
        _prepare_folder(folder, force)

    ids = []
    for index in range(n):
        car_index, view = divmod(index, views)
        car_rng = np.random.default_rng([seed, car_index])
        name = f"{car_rng.bytes(ID_BYTES).hex()}_{view + 1:02d}"
        image, labels = _render(car_rng, np.random.default_rng([seed, car_index, view + 1]), view, size, n_classes)
        image.save(images_dir / f"{name}.jpg", quality=JPEG_QUALITY)
        if n_classes is None:
            mask = Image.fromarray(labels)
            # putpalette turns the grey image into a palette one with the same indices. Carvana's palette: 0 black,
            # 1 white; GIF keeps the indices, which the dataset reads as the mask values.
            mask.putpalette([0, 0, 0, 255, 255, 255])
            mask.save(masks_dir / f"{name}_mask.gif")
        else:
            Image.fromarray(labels).save(masks_dir / f"{name}.png")
        ids.append(name)
    logger.info("Wrote %d images to %s and their masks to %s", n, images_dir, masks_dir)
    return ids


def _prepare_folder(folder: Path, force: bool) -> None:
    """Create ``folder``; refuse to mix with existing data unless ``force``, which deletes the old image files."""
    folder.mkdir(parents=True, exist_ok=True)
    existing = [entry for entry in os.scandir(folder) if not entry.name.startswith(".")]
    if not existing:
        return
    if not force:
        raise DatasetError(
            f"{folder} already holds {len(existing)} entries; pass --force to replace its image files, "
            "or choose an empty output folder"
        )
    # Only image files go: sub-folders and other files may be the user's and are none of our business.
    for entry in existing:
        if entry.is_file() and split_name(entry.name) is not None:
            os.unlink(entry.path)


def _render(
    car_rng: np.random.Generator,
    view_rng: np.random.Generator,
    view: int,
    size: tuple[int, int],
    n_classes: int | None,
) -> tuple[Image.Image, np.ndarray]:
    """Draw one view of one car; return the RGB image and its uint8 label map."""
    width, height = size
    floor_y = int(height * view_rng.uniform(0.66, 0.76))
    background = _studio_background(view_rng, width, height, floor_y)
    parts = _car_parts(car_rng, view_rng, view, width, height, floor_y)
    if n_classes is not None:
        parts += _floor_objects(view_rng, width, height, floor_y, n_classes)

    image = Image.fromarray(background)
    labels = Image.new("L", size, BACKGROUND)
    draw_image, draw_labels = ImageDraw.Draw(image), ImageDraw.Draw(labels)
    _draw_shadow(draw_image, background, parts)
    for part in parts:
        label = part.label if n_classes is not None else int(part.label != BACKGROUND)
        if n_classes is not None and part.label == WINDOWS and n_classes <= WINDOWS:
            label = BODY  # with 3 classes windows count as car body
        for draw, fill in ((draw_image, part.colour), (draw_labels, label)):
            if part.kind == "polygon":
                draw.polygon(part.points, fill=fill)
            else:
                draw.ellipse(part.points, fill=fill)

    # A slight blur and sensor noise, so edges look photographed rather than drawn.
    image = image.filter(ImageFilter.GaussianBlur(radius=max(0.5, width / 960)))
    noise = view_rng.normal(0.0, 3.0, size=(height, width, 1))
    pixels = np.clip(np.asarray(image, dtype=np.float32) + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels), np.asarray(labels)


def _studio_background(rng: np.random.Generator, width: int, height: int, floor_y: int) -> np.ndarray:
    """A light grey wall fading down to a darker floor, split by a floor line."""
    wall_top = rng.uniform(205, 235) + rng.uniform(-6, 6, size=3)
    rows = np.arange(height, dtype=np.float64)[:, None]
    wall = wall_top - 22.0 * (rows / max(floor_y, 1))
    floor = wall_top - 48.0 + 20.0 * (rows - floor_y) / max(height - floor_y, 1)
    column = np.where(rows < floor_y, wall, floor)  # (height, 3)
    column[max(floor_y - 1, 0) : floor_y + 1] -= 30.0
    return np.broadcast_to(np.clip(column, 0, 255)[:, None, :], (height, width, 3)).astype(np.uint8)


def _car_parts(
    car_rng: np.random.Generator, view_rng: np.random.Generator, view: int, width: int, height: int, floor_y: int
) -> list[_Part]:
    """Body, cabin, windows and wheels of a car seen from view ``view`` (0..15, going round it)."""
    hue, saturation, value = car_rng.uniform(0, 1), car_rng.uniform(0.45, 0.95), car_rng.uniform(0.35, 0.9)
    paint = tuple(int(255 * c) for c in colorsys.hsv_to_rgb(hue, saturation, value))
    length_ratio, height_ratio = car_rng.uniform(0.6, 0.75), car_rng.uniform(0.2, 0.27)

    # Seen from the front the car looks narrower; the second half of the views shows the other side (mirrored).
    angle = 2 * math.pi * view / VIEWS_PER_CAR
    car_w = width * length_ratio * (0.55 + 0.45 * abs(math.cos(angle))) * view_rng.uniform(0.9, 1.05)
    body_h = width * length_ratio * height_ratio
    wheel_r = body_h * 0.42
    # Keep the whole car (wheels to roof, about 2.3 body heights) inside the frame.
    shrink = min(1.0, 0.85 * floor_y / (2.3 * body_h))
    car_w, body_h, wheel_r = car_w * shrink, body_h * shrink, wheel_r * shrink
    centre_x = width / 2 + view_rng.uniform(-0.1, 0.1) * width
    centre_x = min(max(centre_x, car_w / 2 + 2), width - car_w / 2 - 2)
    left = centre_x - car_w / 2
    wheel_y = floor_y - wheel_r + view_rng.uniform(-0.02, 0.02) * height
    body_top = wheel_y - body_h * 0.75
    body_bottom = wheel_y + wheel_r * 0.35
    roof = body_top - body_h * car_rng.uniform(0.6, 0.8)
    mirrored = view >= VIEWS_PER_CAR // 2

    def x(fraction: float) -> float:
        return left + car_w * (1 - fraction if mirrored else fraction)

    corner = min(body_h * 0.25, car_w * 0.05)
    body = [
        (x(0), body_top + corner),
        (x(0.04), body_top),
        (x(0.96), body_top),
        (x(1), body_top + corner),
        (x(1), body_bottom),
        (x(0), body_bottom),
    ]
    cabin = [(x(0.22), body_top), (x(0.36), roof), (x(0.68), roof), (x(0.82), body_top)]
    inset = (body_top - roof) * 0.18
    windows = [
        (x(0.27), body_top - inset),
        (x(0.38), roof + inset),
        (x(0.66), roof + inset),
        (x(0.76), body_top - inset),
    ]
    glass = (int(car_rng.uniform(30, 60)), int(car_rng.uniform(40, 70)), int(car_rng.uniform(55, 85)))
    parts = [
        _Part("polygon", tuple(body), paint, BODY),
        _Part("polygon", tuple(cabin), paint, BODY),
        _Part("polygon", tuple(windows), glass, WINDOWS),
    ]
    for fraction in (0.18, 0.82):
        cx = x(fraction)
        parts.append(_Part("ellipse", _circle(cx, wheel_y, wheel_r), (28, 28, 30), WHEELS))
        parts.append(_Part("ellipse", _circle(cx, wheel_y, wheel_r * 0.5), (170, 170, 175), WHEELS))
    return parts


def _floor_objects(rng: np.random.Generator, width: int, height: int, floor_y: int, n_classes: int) -> list[_Part]:
    """One object per extra class (from class 4), most of the time, standing on the floor in front of the car."""
    parts = []
    for label in range(FIRST_OBJECT_CLASS, n_classes):
        if rng.uniform() > 0.8:
            continue
        kind = _OBJECT_KINDS[(label - FIRST_OBJECT_CLASS) % len(_OBJECT_KINDS)]
        # Golden-ratio hue steps keep the class colours far apart; fixed per class so colour identifies it.
        hue = ((label - FIRST_OBJECT_CLASS) * 0.618034) % 1.0
        colour = tuple(int(255 * c) for c in colorsys.hsv_to_rgb(hue, 0.85, 0.85))
        side = height * rng.uniform(0.08, 0.14)
        cx = rng.uniform(side, width - side)
        bottom = min(floor_y + rng.uniform(0.1, 0.9) * (height - floor_y), height - 1)
        if kind == "cone":
            points = ((cx - side / 2, bottom), (cx, bottom - side * 1.4), (cx + side / 2, bottom))
            parts.append(_Part("polygon", points, colour, label))
        elif kind == "box":
            points = (
                (cx - side / 2, bottom - side),
                (cx + side / 2, bottom - side),
                (cx + side / 2, bottom),
                (cx - side / 2, bottom),
            )
            parts.append(_Part("polygon", points, colour, label))
        else:
            parts.append(_Part("ellipse", _circle(cx, bottom - side / 2, side / 2), colour, label))
    return parts


def _draw_shadow(draw: ImageDraw.ImageDraw, background: np.ndarray, parts: Sequence[_Part]) -> None:
    """A soft dark ellipse on the floor under the car (not part of the mask, as in Carvana's photos)."""
    wheels = [part.points for part in parts if part.label == WHEELS]
    left = min(box[0] for box in wheels)
    right = max(box[2] for box in wheels)
    bottom = max(box[3] for box in wheels)
    radius = (bottom - min(box[1] for box in wheels)) / 2
    floor_colour = background[min(int(bottom), background.shape[0] - 1), 0]
    shadow = tuple(int(c * 0.72) for c in floor_colour)
    draw.ellipse(
        (left - radius * 0.5, bottom - radius * 0.35, right + radius * 0.5, bottom + radius * 0.25), fill=shadow
    )


def _circle(cx: float, cy: float, radius: float) -> tuple[float, float, float, float]:
    return (cx - radius, cy - radius, cx + radius, cy + radius)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m utils.datasets.synthetic", description="Write a deterministic Carvana-style demo dataset."
    )
    parser.add_argument("out_dir", type=Path, help="folder that receives imgs/ and masks/")
    parser.add_argument("--n", type=int, default=200, help="number of images (16 views per car; default 200)")
    parser.add_argument("--size", default="480x320", help="image size WIDTHxHEIGHT (default 480x320)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--classes", type=int, default=None, help="K >= 3: multiclass PNG masks with values 0..K-1")
    parser.add_argument("--force", action="store_true", help="replace image files already in imgs/ and masks/")
    parser.add_argument("--views", type=int, default=VIEWS_PER_CAR, help="binary data: images per car (default 16)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    try:
        size = parse_size(args.size, "--size")
        views = args.views if args.classes is None else VIEWS_PER_CAR  # --views is for binary data only
        generate_carvana_like(
            args.out_dir, args.n, size, args.seed, force=args.force, views=views, n_classes=args.classes
        )
    except UserError as err:
        print_error(err)
        return USER_ERROR_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
