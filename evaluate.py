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

if __name__ == "__main__":  # before the heavy imports: Ctrl-C while they run gives one line, not their traceback
    from utils.launch.signals import stop_quietly_while_starting

    stop_quietly_while_starting()

import sys  # noqa: E402 - after the start-up handler above, as every import below
from collections.abc import Sequence

from utils.checkpoint.model import check_expected
from utils.datasets.dataset import BasicDataset
from utils.errors import count
from utils.evaluation import EvalResult, evaluate, evaluate_segmentation
from utils.inference.config import EvaluateConfig, parse_inference_config
from utils.inference.engine import SizeGroupedBatches, align_mask_values, item_loader, open_model, validation_subset
from utils.inference.writer import check_json_path, format_table, write_json
from utils.launch.process_group import run_single_process

__all__ = ["EvalResult", "EvaluateConfig", "evaluate", "evaluate_segmentation", "main", "run"]

OOM_FIX = "lower --batch-size or --scale"


def run(config: EvaluateConfig) -> int:
    """Score the checkpoint on the dataset, write --json if asked, print the table; the exit status."""
    check_json_path(config)
    device, model, spec, scale = open_model(config)
    dataset = BasicDataset(
        config.images_dir,
        config.masks_dir,
        scale,
        None,  # the mask naming, detected from the folder index the dataset builds (each folder is listed once)
        n_classes=model.n_classes,
        channels=model.n_channels if model.n_channels in (1, 3) else None,
        # The model's void values (--ignore-value in training) are not classes: their pixels are not scored.
        ignore_values=spec.inference.ignore_values,
    )
    # The dataset converts photos to a 1- or 3-channel model's kind; its images cannot feed a model of other channels.
    images_from = f"--imgs {config.images_dir}"
    check_expected(spec, {"n_channels": dataset.channels}, config.model, source="--model", images_from=images_from)
    mask_values = align_mask_values(dataset, spec.mask_values, config.model)
    scored = validation_subset(dataset, config, spec.split_digest)
    loader = item_loader(scored, batch_size=config.batch_size, workers=config.workers, pin_memory=device.type == "cuda")
    model.to(device)
    result = evaluate_segmentation(
        model,
        SizeGroupedBatches(loader),
        device,
        n_classes=model.n_classes,
        precision=config.precision,
        progress=config.progress,
        description="Evaluating",
    )
    print(f"{config.model} on {count(result.n_images, 'image')} of {config.images_dir}:")
    print(format_table(result, mask_values, spec.inference.class_names))
    if config.json_path is not None:
        write_json(config, result, mask_values, scale, spec.inference.class_names)
        print(f"Scores written to {config.json_path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_single_process(
        lambda: run(parse_inference_config(EvaluateConfig, "evaluate.py", argv, __doc__)), oom_fix=OOM_FIX
    )


if __name__ == "__main__":
    sys.exit(main())
