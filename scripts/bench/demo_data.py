"""The generated data sets the sections run on: Carvana-style pairs, a few drawn scenes and hard links to them."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

from scripts.bench.context import Context, logged_total_steps

# Distinct scenes drawn for generated data; the other files are hard links to them (see write_linked_dataset).
DISTINCT_FULL_SIZE = 4
DISTINCT_DEMO = 32


def ensure_demo_data(ctx: Context) -> Path:
    """The training data folder: ``--data-dir`` when it holds images, else demo data drawn there (or in work)."""
    config = ctx.config
    folder = config.data_dir or ctx.work_dir / "demo-data"
    generated_here = any(folder.glob(".complete-*"))
    if not generated_here and (folder / "imgs").is_dir() and any((folder / "imgs").iterdir()):
        return folder  # the user's own data, used as it is
    width, height = config.size
    size = (round(width / config.scale), round(height / config.scale))
    needed = max(
        demo_image_count(logged_total_steps(config), config.batch_size),
        config.predict_images,
        max(config.predict_batch_sizes),
    )
    return write_linked_dataset(folder, needed, size, distinct=DISTINCT_DEMO)


def demo_image_count(total_steps: int, batch_size: int, validation_percent: float = 10.0) -> int:
    """Images to draw so that ``total_steps`` batches fit in the first epoch with a batch to spare.

    Staying inside the first epoch keeps validation (run at epoch ends) out of the end-to-end measurement.
    """
    needed_train = (total_steps + 1) * batch_size
    count = math.ceil(needed_train / (1 - validation_percent / 100)) + 1
    return max(16, count)


def write_linked_dataset(folder: Path, count: int, size: tuple[int, int], *, distinct: int) -> Path:
    """``count`` Carvana-style image/mask pairs in ``folder``: ``distinct`` drawn scenes, the rest hard links to them.

    Decoding cost does not depend on the content, and drawing hundreds of full-size scenes would take longer than
    the measurement. Every link is a file name of its own, which the mask scan opens and decodes, and which the
    value cache's key lists (a link shares its target's size and mtime, as a copy made by ``cp -p`` would).
    """
    from utils.datasets.synthetic import generate_carvana_like

    for existing in folder.glob(f".complete-*-{size[0]}x{size[1]}"):
        if int(existing.name.split("-")[1]) >= count:
            return folder  # an earlier, larger set of the same size serves as well
    marker = folder / f".complete-{count}-{size[0]}x{size[1]}"
    # Only folders this function wrote (or empty ones) get here: replace an earlier set of another count or size.
    for old in (*folder.glob(".complete-*"), folder / ".source", folder / "imgs", folder / "masks"):
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink(missing_ok=True)
    source = folder / ".source"
    names = generate_carvana_like(source, min(distinct, count), size=size, seed=0)
    for sub in ("imgs", "masks"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    for index in range(count):
        name = names[index % len(names)]
        # Carvana-style ids (12 hex digits, view number), distinct from the drawn scenes' names.
        new_name = f"{index:012x}_{index % 16 + 1:02d}"
        _link_or_copy(source / "imgs" / f"{name}.jpg", folder / "imgs" / f"{new_name}.jpg")
        _link_or_copy(source / "masks" / f"{name}_mask.gif", folder / "masks" / f"{new_name}_mask.gif")
    marker.touch()
    return folder


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def write_small_pairs(folder: Path, count: int) -> Path:
    """``count`` Carvana-named 16x16 pairs, hard links to one drawn pair: a large folder that is cheap to write.

    Each link is a directory entry of its own, so indexing, pairing and the value cache's key see ``count`` files.
    """
    marker = folder / f".complete-{count}"
    if marker.exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    from utils.datasets.synthetic import generate_carvana_like

    source = folder / ".source"
    name = generate_carvana_like(source, 1, size=(16, 16), seed=0)[0]
    for sub in ("imgs", "masks"):
        (folder / sub).mkdir(parents=True)
    image, mask = source / "imgs" / f"{name}.jpg", source / "masks" / f"{name}_mask.gif"
    for index in range(count):
        _link_or_copy(image, folder / "imgs" / f"{index:012x}.jpg")
        _link_or_copy(mask, folder / "masks" / f"{index:012x}_mask.gif")
    marker.touch()
    return folder
