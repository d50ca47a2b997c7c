"""What ``evaluate.py`` adds to ``utils.evaluation``: masks mapped to a checkpoint's classes, batches, the table.

The collate function runs in loader worker processes: it lives in a module, not in the script, so that it pickles
under any start method.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from utils.datasets.dataset import BasicDataset
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


def keep_items(batch: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """DataLoader collate function: keep the items apart; ``SizeGroupedBatches`` stacks those of one size."""
    return batch


@dataclass(frozen=True)
class SizeGroupedBatches:
    """Stacked batches of up to ``batch_size`` items of one image size, from a loader collated by ``keep_items``.

    Images of mixed sizes are grouped by size (as ``predict.py`` does): nothing is resized or padded, and since the
    score is a mean over images, grouping does not change it. At most ``4 * batch_size`` items wait for a partner.
    """

    loader: DataLoader
    batch_size: int

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        buckets: dict[tuple[int, ...], list[dict[str, torch.Tensor]]] = {}
        for items in self.loader:
            for item in items:
                bucket = buckets.setdefault(tuple(item["image"].shape), [])
                bucket.append(item)
                if len(bucket) == self.batch_size:
                    yield _stack(buckets.pop(tuple(item["image"].shape)))
                elif sum(len(waiting) for waiting in buckets.values()) > 4 * self.batch_size:
                    yield _stack(buckets.pop(max(buckets, key=lambda shape: len(buckets[shape]))))
        for bucket in buckets.values():
            yield _stack(bucket)


def _stack(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def format_table(result: EvalResult, mask_values: Sequence, class_names: Sequence[str] = ()) -> str:
    """Per-class Dice and IoU and their means as an aligned text table (with a name column when classes have names)."""
    labels = ["class", "mask value", *(["name"] if class_names else [])]
    blank = [""] * (len(labels) - 1)
    rows = [(*labels, "Dice", "IoU")]
    for index, (dice, iou) in enumerate(zip(result.per_class_dice, result.per_class_iou, strict=True)):
        value = mask_values[index] if index < len(mask_values) else "?"
        name = [class_names[index] if index < len(class_names) else ""] if class_names else []
        rows.append((str(index), str(value), *name, f"{dice:.4f}", f"{iou:.4f}"))
    foreground = "mean (classes 1+)" if len(result.per_class_dice) > 1 else "mean"
    rows.append((foreground, *blank, f"{result.dice:.4f}", f"{result.iou:.4f}"))
    mean_all_dice = sum(result.per_class_dice) / len(result.per_class_dice)
    mean_all_iou = sum(result.per_class_iou) / len(result.per_class_iou)
    rows.append(("mean (all classes)", *blank, f"{mean_all_dice:.4f}", f"{mean_all_iou:.4f}"))
    if result.micro_per_class_dice:
        # The rows above are per-image means (macro); these score the pixels of the whole dataset at once.
        micro = result.reductions()["micro"]
        rows.append((f"micro {foreground}", *blank, f"{micro['dice']:.4f}", f"{micro['iou']:.4f}"))
        with_background = f"{micro['dice_with_background']:.4f}", f"{micro['iou_with_background']:.4f}"
        rows.append(("micro mean (all classes)", *blank, *with_background))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    text_columns = len(labels)  # left-aligned; the scores are right-aligned
    lines = [
        "  ".join(
            cell.ljust(width) if column < text_columns else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
    return "\n".join(lines[:1] + ["-" * len(lines[0])] + lines[1:])
