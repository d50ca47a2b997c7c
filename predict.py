"""Predict masks for images with a trained UNet (flags compatible with milesial/Pytorch-UNet's predict.py).

    python predict.py -m checkpoints/unet/best.pth -i data/test/ --output-dir preds/
    python predict.py -m checkpoints/unet/best.pth -i a.jpg b.jpg -o a_mask.png b_mask.png
    python predict.py -m MODEL.pth -i 'photos/*.jpg' --viz --masks data/masks/
    python predict.py -m MODEL.pth -i big.tif --tile 512 --precision bf16 --tta
    python predict.py -m MODEL.pth --export onnx model.onnx

Images are prepared as the checkpoint says (its training scale unless --scale is given; grey photos converted for an
RGB model). Masks are written with the dataset's original values (taken from the checkpoint). No output replaces an
input, a checkpoint or another output (checked before anything is written). Exit status: 0 when every image was
predicted, 1 when some images failed (each is named in the log; the others are still written), 2 for a bad flag, model
file or output folder (one ``Error:`` line on stderr).
"""

from __future__ import annotations

if __name__ == "__main__":  # before the heavy imports: Ctrl-C while they run gives one line, not their traceback
    from utils.startup_interrupt import stop_quietly_while_starting

    stop_quietly_while_starting()

import dataclasses  # noqa: E402 - after the start-up handler above, as every import below
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from unet import UNet
from utils import model_spec
from utils.cli import setup_logging
from utils.errors import CheckpointError
from utils.hardware import pick_device, warn_if_emulated
from utils.inference.cli import parse_predict_config
from utils.inference.config import DEFAULT_MASK_THRESHOLD, PredictConfig
from utils.inference.engine import PredictionInputs, predict_items
from utils.inference.export import checkpoint_preprocessing, export_model
from utils.inference.file_plan import (
    check_writable,
    collect_inputs,
    files_in,
    input_folders,
    plan_outputs,
    prediction_outputs,
)
from utils.inference.outputs import check_mask_values, default_mask_values
from utils.inference.overlays import class_colours
from utils.inference.report import prediction_summary
from utils.inference.writer import Writer, write_predictions
from utils.output_files import check_outputs
from utils.runner import run_main
from utils.startup_interrupt import startup_done
from utils.wording import count

__all__ = ["PARTIAL_FAILURE_EXIT_CODE", "PredictConfig", "main", "predict_files", "run"]

logger = logging.getLogger("predict")

PARTIAL_FAILURE_EXIT_CODE = 1
OOM_FIX = "lower --batch-size, or use --tile 512 (or smaller) for large images"


def load_model(config: PredictConfig) -> tuple[UNet, list, float, tuple[str, ...]]:
    """The checkpoint's model (eval mode, on the CPU), the mask value of each of its classes, the image scale and
    the class names (empty when the checkpoint has none)."""
    model, spec = model_spec.load_model(
        config.model, expected={"n_classes": config.classes, "bilinear": True if config.bilinear else None}
    )
    scale = model_spec.resolve_scale(spec, config.scale, config.model)
    mask_values = spec.mask_values
    if mask_values is None:
        mask_values = default_mask_values(model.n_classes)
        logger.warning("%s stores no mask_values; writing classes as %s", config.model, mask_values)
    check_mask_values(mask_values, model.n_classes)
    void = sorted(set(spec.ignore_values) & {v for v in mask_values if isinstance(v, int)})
    if void:
        # A class written as a void value would read back as "not labelled": never write one.
        raise CheckpointError(
            f"{config.model} maps classes to mask value(s) {void} that it was trained to ignore (--ignore-value); "
            "its mask_values are inconsistent, retrain or fix the checkpoint"
        )
    logger.info("Model %s: %s, mask values %s, scale %s", config.model, model.constructor_args(), mask_values, scale)
    if model.n_classes > 1 and config.mask_threshold != DEFAULT_MASK_THRESHOLD:
        logger.warning(
            "--mask-threshold %s is ignored: %s has %d output classes and each pixel gets its most likely class "
            "(the threshold applies to one-logit models, --classes 1)",
            config.mask_threshold,
            config.model,
            model.n_classes,
        )
    return model.eval(), mask_values, scale, spec.class_names


def export(model: UNet, config: PredictConfig, mask_values: list) -> None:
    assert config.export_format is not None and config.export_path is not None
    check_outputs(
        [(config.export_path, "--export")],
        {config.model: "the checkpoint"},
        writes_images=False,
        replaces_torchscript=config.export_format == "torchscript",
    )
    assert config.scale is not None
    # An ONNX file carries how to prepare images for it (utils.inference.export.Preprocessing).
    preprocessing = checkpoint_preprocessing(config.model, mask_values, config.scale, model.n_channels)
    report = export_model(model, config.export_format, config.export_path, config.export_size, preprocessing)
    report_fields = (report.format, report.path, report.checked_with)
    difference = "n/a" if report.max_abs_difference is None else f"{report.max_abs_difference:.3g}"
    logger.info("Exported %s to %s (checked with %s, max |difference| %s)", *report_fields, difference)


def predict_files(
    model: UNet, mask_values: list, config: PredictConfig, device: torch.device, class_names: tuple[str, ...] = ()
) -> int:
    """Predict and write every input of ``config`` (its scale resolved from the checkpoint by ``run``); the exit
    status (see the module docstring)."""
    assert config.scale is not None
    inputs = collect_inputs(config.inputs)
    plans = plan_outputs(inputs, config.inputs, config.outputs, config.output_dir)
    check_outputs(
        prediction_outputs(inputs, plans, masks=not config.no_save, viz=config.viz),
        read_paths(inputs, config),
        input_folders(config.inputs, inputs, config.masks_dir),
    )
    check_writable({plan.mask.parent for plan in plans})
    model.to(device)
    dataset = PredictionInputs(
        inputs,
        config.scale,
        model.n_channels,
        keep_original=config.viz,
        pixel_cache=config.pixel_cache,
        any_size=config.tile is not None,
    )
    colours = class_colours(mask_values, model.n_classes)
    writer = Writer(mask_values, colours, not config.no_save, config.viz, config.masks_dir, class_names)
    predictions = predict_items(
        model,
        dataset,
        device,
        batch_size=config.batch_size,
        precision=config.precision,
        threshold=config.mask_threshold,
        tile=config.tile_settings(),
        workers=config.workers,
        progress=config.progress,
        tta=config.tta,
    )
    failures = write_predictions(predictions, writer, plans)
    if failures:
        logger.error("%d of %s failed (named above)", len(failures), count(len(inputs), "image"))
    folders = {plan.mask.parent for plan in plans} if not config.no_save else set()
    folders.update(plan.viz.parent for plan in plans if config.viz)
    written = len(inputs) - len(failures)
    logger.info(
        "%s", prediction_summary(written, len(inputs), masks=not config.no_save, viz=config.viz, folders=folders)
    )
    return PARTIAL_FAILURE_EXIT_CODE if failures else 0


def read_paths(inputs: Sequence[Path], config: PredictConfig) -> dict[Path, str]:
    """Every file the run reads or must keep: the inputs, the true masks of --viz and the checkpoint."""
    protected = files_in([config.masks_dir] if config.masks_dir is not None else [], "a true mask in --masks")
    protected.update((path, "the input") for path in inputs)
    protected[config.model] = "the checkpoint"
    return protected


def run(config: PredictConfig) -> int:
    """Export and/or predict as ``config`` says; returns the exit status (see the module docstring)."""
    device = pick_device(config.device)
    warn_if_emulated(device, config.precision)
    model, mask_values, scale, class_names = load_model(config)
    config = dataclasses.replace(config, scale=scale)
    if config.export_format is not None:
        export(model, config, mask_values)
        if not config.inputs:
            return 0
    return predict_files(model, mask_values, config, device, class_names)


def main(argv: Sequence[str] | None = None) -> int:
    startup_done()  # the imports are over: Ctrl-C is a KeyboardInterrupt again, reported by run_main
    setup_logging(rank=0, world_size=1)
    return run_main(lambda: run(parse_predict_config(argv, __doc__)), oom_fix=OOM_FIX)


if __name__ == "__main__":
    sys.exit(main())
