"""Score a checkpoint on a folder of images and masks: Dice and IoU per class, and their means.

    python evaluate.py -m checkpoints/best.pth --imgs data/val/imgs --masks data/val/masks [--json scores.json]

The mask naming (``<id>.png`` or Carvana's ``<id>_mask.gif``) is detected. The masks' values must be among the
values the model was trained on (stored in the checkpoint), so that class ``k`` means the same thing to both.
Exit status: 0, or 2 for a bad flag, model file or dataset (one ``Error:`` line on stderr).

``evaluate`` is re-exported from ``utils.evaluation`` so that ``from evaluate import evaluate`` works as in
milesial/Pytorch-UNet.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from utils.checkpoint import build_model_from_checkpoint
from utils.data_loading import BasicDataset, detect_mask_suffix
from utils.errors import USER_ERROR_EXIT_CODE, ConfigError, DatasetError, UserError
from utils.evaluation import EvalResult, evaluate
from utils.inference import PRECISIONS, add_model_check_flags, resolve_device, warn_if_slow_precision
from utils.run_logging import setup_logging

__all__ = ["EvalResult", "EvaluateConfig", "evaluate", "main", "run"]

logger = logging.getLogger("evaluate")


@dataclass
class EvaluateConfig:
    """Everything ``evaluate.py`` needs, validated once by ``validate``."""

    model: Path
    images_dir: Path
    masks_dir: Path
    scale: float = 0.5
    """Resize factor of images and masks, in (0, 1]; use the one the model was trained with."""
    batch_size: int = 1
    """Images per forward pass; images in one batch must share a size."""
    precision: str = "fp32"
    device: str = "auto"
    workers: int = 2
    json_path: Path | None = None
    """Also write the scores as JSON here."""
    bilinear: bool = False
    """milesial's flag; the checkpoint decides the architecture, a contradicting flag is an error."""
    classes: int | None = None
    """milesial's flag; the checkpoint decides the architecture, a contradicting flag is an error."""
    progress: bool = True

    def validate(self) -> None:
        if not 0.0 < self.scale <= 1.0:
            raise ConfigError(f"--scale {self.scale}: use a factor in (0, 1]")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size {self.batch_size}: use 1 or more")
        if self.workers < 0:
            raise ConfigError(f"--workers {self.workers}: use 0 (load in the main process) or more")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", "-m", default="MODEL.pth", metavar="FILE", help="checkpoint to score (MODEL.pth)")
    parser.add_argument("--imgs", required=True, metavar="DIR", help="folder of images")
    parser.add_argument("--masks", required=True, metavar="DIR", help="folder of true masks")
    parser.add_argument("--scale", "-s", type=float, default=0.5, help="downscaling factor of the images (0.5)")
    parser.add_argument("--batch-size", "-b", type=int, default=4, help="images per forward pass (4)")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32", help="forward-pass precision")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: cuda when available)")
    parser.add_argument("--workers", "-j", type=int, default=2, help="data-loading worker processes (2)")
    parser.add_argument("--json", metavar="FILE", help="also write the scores as JSON to FILE")
    add_model_check_flags(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def config_from_args(args: argparse.Namespace) -> EvaluateConfig:
    config = EvaluateConfig(
        model=Path(args.model),
        images_dir=Path(args.imgs),
        masks_dir=Path(args.masks),
        scale=args.scale,
        batch_size=args.batch_size,
        precision=args.precision,
        device=args.device,
        workers=args.workers,
        json_path=Path(args.json) if args.json else None,
        bilinear=args.bilinear,
        classes=args.classes,
        progress=not args.no_progress,
    )
    config.validate()
    return config


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


def _stack_same_size(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    shapes = {tuple(item["image"].shape) for item in batch}
    if len(shapes) > 1:
        raise DatasetError(f"images of different sizes {sorted(shapes)} in one batch; use --batch-size 1")
    return {key: torch.stack([item[key] for item in batch]) for key in batch[0]}


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


def run(config: EvaluateConfig) -> tuple[EvalResult, list]:
    """Score the checkpoint on the dataset; returns the result and the mask values its classes stand for."""
    device = resolve_device(config.device)
    warn_if_slow_precision(device, config.precision)
    model, checkpoint_values = build_model_from_checkpoint(
        config.model, n_classes=config.classes, bilinear=True if config.bilinear else None
    )
    mask_suffix = detect_mask_suffix(config.images_dir, config.masks_dir)
    dataset = BasicDataset(config.images_dir, config.masks_dir, config.scale, mask_suffix, n_classes=model.n_classes)
    mask_values = align_mask_values(dataset, checkpoint_values, config.model)
    if dataset[0]["image"].shape[0] != model.n_channels:
        raise DatasetError(
            f"the images in {config.images_dir} have {dataset[0]['image'].shape[0]} channel(s) but "
            f"{config.model} expects {model.n_channels}"
        )
    loader = DataLoader(
        dataset,
        batch_size=config.batch_size,
        shuffle=False,
        num_workers=config.workers,
        collate_fn=_stack_same_size,
        pin_memory=device.type == "cuda",
    )
    model.to(device)
    result = evaluate(
        model, loader, device, n_classes=model.n_classes, precision=config.precision, progress=config.progress
    )
    return result, mask_values


def write_json(path: Path, result: EvalResult, mask_values: list, config: EvaluateConfig) -> None:
    payload = {
        "checkpoint": str(config.model),
        "images": str(config.images_dir),
        "masks": str(config.masks_dir),
        "scale": config.scale,
        "mask_values": mask_values,
        **result.as_dict(),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"--json {path}: cannot write it ({error.strerror or error})") from error


def main(argv: Sequence[str] | None = None) -> int:
    setup_logging(rank=0, world_size=1)
    try:
        config = config_from_args(build_parser().parse_args(argv))
        result, mask_values = run(config)
        if config.json_path is not None:
            write_json(config.json_path, result, mask_values, config)
    except UserError as error:
        print(f"Error: {error}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    except torch.cuda.OutOfMemoryError:
        print("Error: the GPU ran out of memory; lower --batch-size or --scale", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    except SystemExit as exit_request:  # --help, or argparse's own usage error (status 2)
        return exit_request.code if isinstance(exit_request.code, int) else 0
    print(f"{config.model} on {result.n_images} images of {config.images_dir}:")
    print(format_table(result, mask_values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
