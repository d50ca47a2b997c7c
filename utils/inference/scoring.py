"""What ``evaluate.py`` adds to ``utils.evaluation``: masks mapped to a checkpoint's classes, batches, the table,
and ``--json`` (checked before the run, written whole)."""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from utils.datasets.dataset import BasicDataset
from utils.errors import DatasetError
from utils.evaluation import EvalResult
from utils.hardware import SharedMemoryGuard
from utils.inference.config import EvaluateConfig
from utils.inference.engine import batches_by_shape
from utils.inference.file_plan import read_files
from utils.output_files import check_outputs, write_text

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
class SizeGroupedBatches:
    """Stacked batches of up to the loader's ``batch_size`` items of one image size, from ``engine.item_loader``'s
    lists of items.

    Images of mixed sizes are grouped by size as ``predict.py`` groups them (``batches_by_shape``): since the score is a
    mean over images, grouping does not change it.
    """

    loader: SharedMemoryGuard

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        items = itertools.chain.from_iterable(self.loader)
        for batch in batches_by_shape(items, self.loader.batch_size, lambda item: item["image"].shape):
            yield {key: torch.stack([item[key] for item in batch]) for key in batch[0]}


def format_table(result: EvalResult, mask_values: Sequence, class_names: Sequence[str] = ()) -> str:
    """Per-class Dice and IoU and their means as an aligned text table (with a name column when classes have names)."""
    labels = ["class", "mask value", *(["name"] if class_names else [])]
    rows = [[*labels, "Dice", "IoU"]]
    for index, (dice, iou) in enumerate(zip(result.per_class_dice, result.per_class_iou, strict=True)):
        value = mask_values[index] if index < len(mask_values) else "?"
        name = [class_names[index] if index < len(class_names) else ""] if class_names else []
        rows.append([str(index), str(value), *name, f"{dice:.4f}", f"{iou:.4f}"])
    # Macro rows are per-image means; micro rows score the pixels of the whole dataset at once.
    foreground = "mean (classes 1+)" if len(result.per_class_dice) > 1 else "mean"
    for prefix, scores in (("", result.reductions()["macro"]), ("micro ", result.reductions()["micro"])):
        for label, key in ((foreground, ""), ("mean (all classes)", "_with_background")):
            scored = [f"{scores['dice' + key]:.4f}", f"{scores['iou' + key]:.4f}"]
            rows.append([prefix + label, *[""] * (len(labels) - 1), *scored])
    widths = [max(map(len, column)) for column in zip(*rows, strict=True)]
    lines = [
        "  ".join(
            # The text columns left-aligned, the scores right-aligned.
            cell.ljust(width) if column < len(labels) else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
    return "\n".join(lines[:1] + ["-" * len(lines[0])] + lines[1:])


def check_json_path(config: EvaluateConfig) -> None:
    """``--json`` must not replace an image, a mask or a checkpoint (checked before anything runs)."""
    if config.json_path is None:
        return
    protected = read_files(
        config.model, {config.images_dir: "an image in --imgs", config.masks_dir: "a mask in --masks"}
    )
    check_outputs([(config.json_path, "--json")], protected, [config.images_dir, config.masks_dir], writes_images=False)


def write_json(
    config: EvaluateConfig, result: EvalResult, mask_values: list, scale: float, class_names: tuple[str, ...] = ()
) -> None:
    """The scores as ``--json`` FILE, with what was scored and how."""
    assert config.json_path is not None
    payload = {
        "checkpoint": str(config.model),
        "images": str(config.images_dir),
        "masks": str(config.masks_dir),
        **({"split": str(config.split_path)} if config.split_path is not None else {}),
        "scale": scale,
        "mask_values": mask_values,
        **({"class_names": list(class_names)} if class_names else {}),
        **result.as_dict(),
    }
    write_text(config.json_path, json.dumps(payload, indent=2) + "\n", role="--json")
