"""Carvana-style demo data, so the trainer can be tried without downloading anything.

    python -m utils.datasets.synthetic data/ --n 200 --size 480x320 --seed 0            # binary, Carvana's layout
    python -m utils.datasets.synthetic data/ --n 200 --size 480x320 --classes 4         # multiclass

Binary data uses Carvana's layout exactly: ``imgs/<id>_<nn>.jpg`` and ``masks/<id>_<nn>_mask.gif`` (palette GIF,
indices 0 = background, 1 = car), ``<id>`` 12 hex digits per car and ``<nn>`` 01..16 its views; train on it with
``CarvanaDataset``. ``--views V`` gives each car V views instead (``<id>_01`` .. ``<id>_<V>``; e.g. 48 images of 12
cars with ``--n 48 --views 4``), for trying group-aware splits. Multiclass data writes ``imgs/<id>_<nn>.jpg`` and
``masks/<id>_<nn>.png`` (no mask suffix, 8-bit grey class indices; train with ``BasicDataset``): 0 background, 1 car
body, 2 wheels, 3 windows, and from 4 on one kind of floor object per class (a disc or a box, each class its own
colour).

Each car has its own paint and proportions; its views go round it (narrower from the front, the other side mirrored)
in front of a studio wall, photographed (a slight blur and sensor noise). The same arguments always give
byte-identical files. Existing non-empty folders are only replaced with ``force``.
"""

from __future__ import annotations

import argparse
import colorsys
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from utils.cli import parse_size, print_error
from utils.datasets.image_files import split_name
from utils.errors import USER_ERROR_EXIT_CODE, ConfigError, DatasetError, UserError
from utils.flags import check_range

logger = logging.getLogger(__name__)

DEFAULT_SIZE = (480, 320)
VIEWS_PER_CAR = 16
ID_BYTES = 6  # 12 hex digits, as Carvana's ids
MIN_SIDE = 16
MAX_CLASSES = 255  # masks are 8-bit PNGs
JPEG_QUALITY = 90

BACKGROUND, BODY, WHEELS, WINDOWS = 0, 1, 2, 3
FIRST_OBJECT_CLASS = 4
# A car seen from its side, part by part as (class, PIL shape, points): x from its rear (0) to its front (1), y from
# its roof (0) to the bottom of its wheels (1), in the box a view gives it. Later parts are drawn over earlier ones.
_CAR_PARTS = (
    (BODY, "polygon", ((0, 0.5), (0.04, 0.4), (0.96, 0.4), (1, 0.5), (1, 0.85), (0, 0.85))),
    (BODY, "polygon", ((0.22, 0.4), (0.36, 0), (0.68, 0), (0.82, 0.4))),
    (WINDOWS, "polygon", ((0.27, 0.36), (0.38, 0.07), (0.66, 0.07), (0.76, 0.36))),
    (WHEELS, "ellipse", ((0.08, 0.62), (0.28, 1))),
    (WHEELS, "ellipse", ((0.72, 0.62), (0.92, 1))),
)


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
    check_range(n, "--n", "[1, inf)")
    check_range(views, "--views", "[1, 99]")
    check_range(min(size), "--size's width and height", f"[{MIN_SIDE}, inf)")
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
            # putpalette turns the grey image into a palette one with the same indices. Carvana's palette: 0 black,
            # 1 white; GIF keeps the indices, which the dataset reads as the mask values.
            labels.putpalette([0, 0, 0, 255, 255, 255])
        labels.save(masks_dir / (f"{name}_mask.gif" if n_classes is None else f"{name}.png"))
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
    car_rng: np.random.Generator, view_rng: np.random.Generator, view: int, size: tuple[int, int], n_classes: int | None
) -> tuple[Image.Image, Image.Image]:
    """Draw one view of one car; return the RGB photo and its grey mask (class indices)."""
    width, height = size
    floor_y = int(height * view_rng.uniform(0.66, 0.76))
    # The car's paint and proportions are its own; a view shows it narrower from the front (views go round it).
    paint = colorsys.hsv_to_rgb(car_rng.uniform(0, 1), car_rng.uniform(0.45, 0.95), car_rng.uniform(0.35, 0.9))
    length, tallness = width * car_rng.uniform(0.6, 0.75), car_rng.uniform(0.45, 0.6)
    car_w = length * (0.55 + 0.45 * abs(math.cos(2 * math.pi * view / VIEWS_PER_CAR))) * view_rng.uniform(0.9, 1.05)
    shrink = min(1.0, 0.85 * floor_y / (length * tallness))  # the whole car inside the frame
    car_w, car_h = car_w * shrink, length * tallness * shrink
    left = min(max(width / 2 - car_w / 2 + view_rng.uniform(-0.1, 0.1) * width, 2), width - car_w - 2)
    top = floor_y - car_h + view_rng.uniform(-0.02, 0.02) * height

    labels = Image.new("L", size, BACKGROUND)
    draw = ImageDraw.Draw(labels)
    for label, shape, points in _CAR_PARTS:
        getattr(draw, shape)([(left + car_w * x, top + car_h * y) for x, y in points], fill=label)
    # Multiclass: one object per extra class (from class 4), most of the time, on the floor in front of the car.
    for label in range(FIRST_OBJECT_CLASS, n_classes or 0):
        side = view_rng.uniform(0.08, 0.14) * height
        x = view_rng.uniform(side, width - side)
        bottom = min(floor_y + view_rng.uniform(0.1, 0.9) * (height - floor_y), height - 1)
        if view_rng.uniform() < 0.8:
            box = [(x - side / 2, bottom - side), (x + side / 2, bottom)]
            getattr(draw, ("ellipse", "rectangle")[label % 2])(box, fill=label)
    classes = np.asarray(labels)
    if view >= VIEWS_PER_CAR // 2:  # the second half of the views shows the car's other side
        classes = np.ascontiguousarray(classes[:, ::-1])

    # Each class its colour (paint, tyres, glass; golden-ratio hue steps keep the objects' far apart) on a light wall
    # that fades down to a darker floor; then a slight blur and sensor noise, so edges look photographed.
    hues = [(k * 0.618034) % 1.0 for k in range((n_classes or 0) - FIRST_OBJECT_CLASS)]
    colours = 255 * np.array(
        [(0, 0, 0), paint, (0.11, 0.11, 0.12), (0.18, 0.22, 0.27)]
        + [colorsys.hsv_to_rgb(hue, 0.85, 0.85) for hue in hues]
    )
    rows = np.arange(height, dtype=np.float64)[:, None, None]
    tone = view_rng.uniform(205, 235) + view_rng.uniform(-6, 6, size=3)
    wall = np.where(rows < floor_y, tone - 22 * rows / height, tone - 48)
    photo = Image.fromarray(np.where(classes[..., None] == BACKGROUND, wall, colours[classes]).astype(np.uint8))
    photo = photo.filter(ImageFilter.GaussianBlur(radius=max(0.5, width / 960)))
    noise = view_rng.normal(0.0, 3.0, size=(height, width, 1))
    photo = Image.fromarray(np.clip(np.asarray(photo, dtype=np.float32) + noise, 0, 255).astype(np.uint8))
    # Binary masks: the whole car is 1. With 3 classes the windows count as car body.
    merged = {None: [0, 1, 1, 1], 3: [0, BODY, WHEELS, BODY]}.get(n_classes)
    return photo, Image.fromarray(classes if merged is None else np.array(merged, dtype=np.uint8)[classes])


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
