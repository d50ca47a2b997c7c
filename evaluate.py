"""Score a checkpoint on a folder of images and masks: Dice and IoU per class, and their means.

    python evaluate.py -m checkpoints/unet/best.pth --imgs data/val/imgs --masks data/val/masks [--json scores.json]

The mask naming (``<id>.png`` or Carvana's ``<id>_mask.gif``) is detected. The masks' values must be among the
values the model was trained on (stored in the checkpoint), so that class ``k`` means the same thing to both. Images
are prepared as the checkpoint says: its training scale unless ``--scale`` is given, grey photos converted for an RGB
model (and the reverse); images of different sizes are batched by size. predict.py's ``*_OUT``/``*_VIZ`` files in
the folders are ignored. Exit status: 0, or 2 for a bad flag, model file or dataset (one ``Error:`` line on stderr).

``evaluate`` is re-exported from ``utils.evaluation`` so that ``from evaluate import evaluate`` works as in
milesial/Pytorch-UNet: ``evaluate(net, dataloader, device, amp)`` returns the mean Dice; the per-class result is
``evaluate_segmentation``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from utils import model_spec
from utils.cli import print_error, setup_logging
from utils.data_loading import BasicDataset, detect_mask_suffix
from utils.errors import USER_ERROR_EXIT_CODE, ConfigError, DatasetError, UserError
from utils.evaluation import EvalResult, evaluate, evaluate_segmentation
from utils.hardware import pick_device, warn_if_emulated
from utils.inference.config import EvaluateConfig
from utils.inference.file_plan import check_no_clashes, files_in
from utils.inference.flags import add_compute_flags, add_model_check_flags, add_progress_flag, add_scale_flag
from utils.inference.memory import is_allocator_error
from utils.inference.scoring import SizeGroupedBatches, align_mask_values, format_table, keep_items

__all__ = ["EvalResult", "EvaluateConfig", "evaluate", "evaluate_segmentation", "main", "run"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", "-m", default="MODEL.pth", metavar="FILE", help="checkpoint to score (MODEL.pth)")
    parser.add_argument("--imgs", required=True, metavar="DIR", help="folder of images")
    parser.add_argument("--masks", required=True, metavar="DIR", help="folder of true masks")
    add_scale_flag(parser)
    add_compute_flags(parser, workers_help="data-loading")
    parser.add_argument("--json", metavar="FILE", help="also write the scores as JSON to FILE")
    add_model_check_flags(parser)
    add_progress_flag(parser)
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


def check_json_path(config: EvaluateConfig) -> None:
    """``--json`` must not replace an image, a mask or a checkpoint (checked before anything runs)."""
    if config.json_path is None:
        return
    protected = files_in([config.images_dir], "an image in --imgs")
    protected.update(files_in([config.masks_dir], "a mask in --masks"))
    protected[config.model] = "the checkpoint"
    check_no_clashes([(config.json_path, "--json")], protected)


def run(config: EvaluateConfig) -> tuple[EvalResult, list, float]:
    """Score the checkpoint on the dataset; returns the result, the mask values its classes stand for, the scale."""
    device = pick_device(config.device)
    warn_if_emulated(device, config.precision)
    check_json_path(config)
    model, spec = model_spec.load_model(
        config.model, expected={"n_classes": config.classes, "bilinear": True if config.bilinear else None}
    )
    scale = model_spec.resolve_scale(spec, config.scale, config.model)
    mask_suffix = detect_mask_suffix(config.images_dir, config.masks_dir)
    dataset = BasicDataset(
        config.images_dir,
        config.masks_dir,
        scale,
        mask_suffix,
        n_classes=model.n_classes,
        channels=model.n_channels if model.n_channels in (1, 3) else None,
        # The model's void values (--ignore-value in training) are not classes: their pixels are not scored.
        ignore_values=spec.ignore_values,
    )
    mask_values = align_mask_values(dataset, spec.mask_values, config.model)
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
        collate_fn=keep_items,
        pin_memory=device.type == "cuda",
    )
    model.to(device)
    result = evaluate_segmentation(
        model,
        SizeGroupedBatches(loader, config.batch_size),
        device,
        n_classes=model.n_classes,
        precision=config.precision,
        progress=config.progress,
    )
    return result, mask_values, scale


def write_json(path: Path, result: EvalResult, mask_values: list, scale: float, config: EvaluateConfig) -> None:
    payload = {
        "checkpoint": str(config.model),
        "images": str(config.images_dir),
        "masks": str(config.masks_dir),
        "scale": scale,
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
        result, mask_values, scale = run(config)
        if config.json_path is not None:
            write_json(config.json_path, result, mask_values, scale, config)
    except UserError as error:
        print_error(error)
        return USER_ERROR_EXIT_CODE
    except (torch.cuda.OutOfMemoryError, MemoryError, RuntimeError) as error:
        if not is_allocator_error(error):
            raise
        print_error("out of memory; lower --batch-size or --scale")
        return USER_ERROR_EXIT_CODE
    except SystemExit as exit_request:  # --help, or argparse's own usage error (status 2)
        return exit_request.code if isinstance(exit_request.code, int) else 0
    print(f"{config.model} on {result.n_images} images of {config.images_dir}:")
    print(format_table(result, mask_values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
