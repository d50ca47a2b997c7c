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

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from torch.utils.data import DataLoader

from utils import model_spec
from utils.cli import setup_logging
from utils.datasets.dataset import BasicDataset
from utils.errors import ConfigError, DatasetError
from utils.evaluation import EvalResult, evaluate, evaluate_segmentation
from utils.hardware import pick_device, warn_if_emulated
from utils.inference.cli import parse_evaluate_config
from utils.inference.config import EvaluateConfig
from utils.inference.file_plan import check_no_clashes, files_in
from utils.inference.scoring import SizeGroupedBatches, align_mask_values, format_table, keep_items
from utils.runner import run_main

__all__ = ["EvalResult", "EvaluateConfig", "evaluate", "evaluate_segmentation", "main", "run"]

OOM_FIX = "lower --batch-size or --scale"


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
    dataset = BasicDataset(
        config.images_dir,
        config.masks_dir,
        scale,
        None,  # the mask naming, detected from the folder index the dataset builds (each folder is listed once)
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
    return run_main(lambda: score_and_report(parse_evaluate_config(argv, __doc__)), oom_fix=OOM_FIX)


def score_and_report(config: EvaluateConfig) -> int:
    """Score, write --json if asked, print the table; the exit status."""
    result, mask_values, scale = run(config)
    if config.json_path is not None:
        write_json(config.json_path, result, mask_values, scale, config)
    print(f"{config.model} on {result.n_images} images of {config.images_dir}:")
    print(format_table(result, mask_values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
