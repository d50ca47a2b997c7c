"""What ``evaluate.py`` adds to ``utils.evaluation``: masks mapped to a checkpoint's classes, batches, the table.

The collate function runs in loader worker processes: it lives in a module, not in the script, so that it pickles
under any start method, and it raises nothing there (see ``stack_same_size``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from utils.data_loading import BasicDataset
from utils.errors import DatasetError
from utils.evaluation import EvalResult

logger = logging.getLogger(__name__)


def align_mask_values(dataset: BasicDataset, checkpoint_values: list | None, checkpoint: Path) -> list:
    """Make the dataset map mask values to the checkpoint's classes; raise ``DatasetError`` if it cannot.

    A validation set may lack some classes, so its values only need to be among the checkpoint's; the dataset then
    uses the checkpoint's full list, so that value ``v`` becomes the class the model was trained to predict for it.
    """
    dataset_values = [_comparable(value) for value in dataset.mask_values]
    if checkpoint_values is None:
        logger.warning(
            "%s stores no mask_values; assuming the masks' values %s are its classes in order",
            checkpoint,
            dataset.mask_values,
        )
        return list(dataset.mask_values)
    known = [_comparable(value) for value in checkpoint_values]
    unknown = [value for value in dataset_values if value not in known]
    if unknown:
        raise DatasetError(
            f"the masks in {dataset.mask_dir} hold values {dataset.mask_values} but {checkpoint} was trained on "
            f"{list(checkpoint_values)} ({unknown} unknown to it); evaluate on masks made the same way as its "
            "training masks"
        )
    if dataset_values != known:
        logger.info("The masks use %s of the checkpoint's mask values %s", dataset.mask_values, checkpoint_values)
        dataset.mask_values = list(checkpoint_values)
    return list(checkpoint_values)


def _comparable(value: object) -> object:
    return tuple(int(channel) for channel in value) if isinstance(value, list | tuple) else int(value)


@dataclass(frozen=True)
class MixedSizes:
    """What ``stack_same_size`` returns for a batch it cannot stack: the image shapes it found."""

    shapes: list[tuple[int, ...]]


def stack_same_size(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor] | MixedSizes:
    """DataLoader collate function: stack a batch whose images share a size (evaluation never resizes or pads).

    It runs in loader workers, where an exception would reach the user as a worker traceback; so a batch of mixed
    sizes comes back as ``MixedSizes`` and ``SameSizeBatches`` raises the error in the main process.
    """
    shapes = {tuple(item["image"].shape) for item in batch}
    if len(shapes) > 1:
        return MixedSizes(sorted(shapes))
    return {key: torch.stack([item[key] for item in batch]) for key in batch[0]}


@dataclass(frozen=True)
class SameSizeBatches:
    """The batches of a loader collated by ``stack_same_size``; a batch of mixed sizes raises ``DatasetError``."""

    loader: DataLoader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for batch in self.loader:
            if isinstance(batch, MixedSizes):
                raise DatasetError(f"images of different sizes {batch.shapes} in one batch; use --batch-size 1")
            yield batch


def format_table(result: EvalResult, mask_values: Sequence) -> str:
    """Per-class Dice and IoU and their means as an aligned text table."""
    rows = [("class", "mask value", "Dice", "IoU")]
    for index, (dice, iou) in enumerate(zip(result.per_class_dice, result.per_class_iou, strict=True)):
        value = mask_values[index] if index < len(mask_values) else "?"
        rows.append((str(index), str(value), f"{dice:.4f}", f"{iou:.4f}"))
    foreground = "mean (classes 1+)" if len(result.per_class_dice) > 1 else "mean"
    rows.append((foreground, "", f"{result.dice:.4f}", f"{result.iou:.4f}"))
    mean_all_dice = sum(result.per_class_dice) / len(result.per_class_dice)
    mean_all_iou = sum(result.per_class_iou) / len(result.per_class_iou)
    rows.append(("mean (all classes)", "", f"{mean_all_dice:.4f}", f"{mean_all_iou:.4f}"))
    widths = [max(len(row[column]) for row in rows) for column in range(4)]
    lines = [
        "  ".join(
            cell.ljust(width) if column < 2 else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
    return "\n".join(lines[:1] + ["-" * len(lines[0])] + lines[1:])
