"""Writing predictions: masks and overlays encoded in writer threads, overlapping the next forward passes; the run's
last line says what was written where, so a person knows where to look.

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

from utils.errors import UserError, count
from utils.inference.config import PredictConfig
from utils.inference.engine import InputItem
from utils.inference.export import Preprocessing
from utils.inference.file_plan import OutputPlan
from utils.inference.outputs import mask_to_image
from utils.inference.overlays import find_truth_mask, load_truth_classes, render_visualization
from utils.output_files import OutputError, write_file

logger = logging.getLogger(__name__)

# Folders named in full; a run writing beside inputs in more folders names these and counts the rest.
MAX_FOLDERS_NAMED = 3
# Predictions written at most this many images ahead of the writer threads, to bound memory.
MAX_PENDING_WRITES = 16


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
