"""Writing predictions: masks and overlays encoded in writer threads, overlapping the next forward passes; the run's
last line says what was written where, so a person knows where to look.

Class ``k`` is written as ``mask_values[k]``, as in milesial/Pytorch-UNet's ``mask_to_image``, so a prediction can be
compared with (or used in place of) the masks the model was trained on:

* ``[0, 1]`` (Carvana) becomes a 1-bit PNG (PIL mode ``'1'``);
* other grey values become an 8-bit ``'L'`` image, or 16-bit ``'I;16'`` when a value does not fit in a byte;
* colour values (``[r, g, b]`` lists, one per class) become an ``'RGB'`` image (``'LA'``/``'RGBA'`` for 2/4 channels).

Each file goes through ``utils.output_files`` (all or nothing). A failure of one file is that image's failure; a
failure of the output location (a full disk, a read-only folder) ends the run with one error, since every later
write would fail the same way.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from utils.checkpoint.model import ModelSpec
from utils.errors import CheckpointError, UserError, count
from utils.inference.config import PredictConfig
from utils.inference.export import Preprocessing
from utils.inference.file_plan import OutputPlan
from utils.inference.overlays import find_truth_mask, load_truth_classes, render_visualization
from utils.output_files import OutputError, write_file

if TYPE_CHECKING:  # utils.inference.engine imports the mask value checks from here
    from utils.inference.engine import InputItem

logger = logging.getLogger(__name__)

# Folders named in full; a run writing beside inputs in more folders names these and counts the rest.
MAX_FOLDERS_NAMED = 3
# Predictions written at most this many images ahead of the writer threads, to bound memory.
MAX_PENDING_WRITES = 16

MAX_PNG_GREY_VALUE = 2**16 - 1


def mask_values_to_write(spec: ModelSpec, checkpoint: Path) -> list:
    """The mask value each class is written as: the checkpoint's, else ``[0, 1]`` for a binary model (milesial's
    default) and the class numbers for more classes, with one warning.

    ``CheckpointError`` for values a mask file cannot hold: a grey value too wide for a 16-bit PNG (written as it is
    it would wrap around: another class's value, silently), or a void value (``--ignore-value`` in training), which
    would read back as "not labelled". Everything else about them (one per class, unique, integers or colours of 2-4
    channels of 0..255) is checked where the file is read (``utils.checkpoint.model``).
    """
    mask_values = spec.mask_values
    if mask_values is None:
        mask_values = [0, 1] if spec.n_classes <= 2 else list(range(spec.n_classes))
        logger.warning("%s stores no mask_values; writing classes as %s", checkpoint, mask_values)
    too_wide = [value for value in mask_values if not isinstance(value, Sequence) and value > MAX_PNG_GREY_VALUE]
    if too_wide:
        raise CheckpointError(
            f"the checkpoint's mask value {too_wide[0]} does not fit a 16-bit PNG mask (at most {MAX_PNG_GREY_VALUE}); "
            f"evaluate.py scores this model, but its masks cannot be written as images"
        )
    void = sorted(set(spec.inference.ignore_values) & {value for value in mask_values if isinstance(value, int)})
    if void:
        raise CheckpointError(
            f"{checkpoint} maps classes to mask value(s) {void} that it was trained to ignore (--ignore-value); "
            "its mask_values are inconsistent, retrain or fix the checkpoint"
        )
    return mask_values


def mask_to_image(class_mask: np.ndarray, mask_values: Sequence) -> Image.Image:
    """Map a ``[H, W]`` array of class indices to a PIL image holding ``mask_values[class]`` per pixel (one value
    per class the model predicts: the checkpoint's reader checked that, ``utils.checkpoint.model``); Pillow takes the
    mode from the table's type and shape (see the module docstring)."""
    assert class_mask.ndim == 2, class_mask.shape
    table = np.asarray(mask_values)
    if table.ndim == 2:  # colours of 2, 3 or 4 channels
        table = table.astype(np.uint8)
    elif len(table) == 2 and sorted(table.tolist()) == [0, 1]:
        table = table.astype(bool)
    else:
        table = table.astype(np.uint16 if table.max(initial=0) > 255 else np.uint8)
    return Image.fromarray(table[class_mask])


def write_prediction(
    item: InputItem, plan: OutputPlan, preprocessing: Preprocessing, config: PredictConfig
) -> str | None:
    """Write one predicted input's files as ``config`` says (--no-save, --viz, the true masks of --masks) with the
    checkpoint's mask values and class names; returns an error message instead of raising (the input's own when it
    could not be read), except for an ``OutputError`` of the output location (see the module docstring)."""
    if item.classes is None:
        return item.error
    try:
        if not config.no_save:
            mask = mask_to_image(item.classes, preprocessing.mask_values)
            write_file(plan.mask, mask.save, f"the mask of {item.path}")
        if config.viz:
            assert item.original is not None
            truth = None
            if config.masks_dir is not None:
                truth_path = find_truth_mask(config.masks_dir, item.path)
                if truth_path is None:
                    logger.warning(
                        "no true mask for %s in %s; writing the prediction overlay alone", item.path, config.masks_dir
                    )
                else:
                    truth = load_truth_classes(truth_path, preprocessing.mask_values, item.original_size)
            overlay = render_visualization(item.original, item.classes, preprocessing, truth)
            write_file(plan.viz, overlay.save, f"the overlay of {item.path}")
    except (OSError, ValueError, UserError) as error:
        if isinstance(error, OutputError) and error.location_failure:
            raise
        return f"{item.path}: could not write its output: {error}"
    return None


def write_predictions(
    predictions: Generator[InputItem, None, None],
    plans: Sequence[OutputPlan],
    preprocessing: Preprocessing,
    config: PredictConfig,
) -> list[str]:
    """Write every prediction (``write_prediction``) in writer threads; returns the failures (each logged), inputs'
    and writes'.

    At most ``MAX_PENDING_WRITES`` predictions wait for a thread, so a fast model cannot fill memory with them. An
    ``OutputError`` of the output location is raised once the threads stop; writes not yet started are cancelled and
    ``predictions`` is closed (its loader workers stop) so that nothing waits for them.
    """
    failures: list[str] = []
    pending: deque[Future] = deque()

    def collect(future: Future) -> None:
        message = future.result()
        if message is not None:
            logger.error("%s", message)
            failures.append(message)

    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="predict-writer")
    try:
        for item in predictions:
            pending.append(pool.submit(write_prediction, item, plans[item.index], preprocessing, config))
            while len(pending) > MAX_PENDING_WRITES:
                collect(pending.popleft())
        while pending:
            collect(pending.popleft())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        predictions.close()
    return failures


def prediction_summary(written: int, total: int, *, masks: bool, viz: bool, folders: Sequence[Path]) -> str:
    """``"Wrote 8 masks and 8 overlays (8 of 8 images) to outputs/demo"``; ``folders``: where the outputs go."""
    kinds = [count(written, noun) for noun, wanted in (("mask", masks), ("overlay", viz)) if wanted]
    names = sorted({str(folder) for folder in folders})
    where = ", ".join(names[:MAX_FOLDERS_NAMED])
    if len(names) > MAX_FOLDERS_NAMED:
        where += f" and {count(len(names) - MAX_FOLDERS_NAMED, 'other folder')}"
    what = " and ".join(kinds) if kinds else "nothing (--no-save without --viz)"
    return f"Wrote {what} ({written} of {count(total, 'image')}) to {where}"
