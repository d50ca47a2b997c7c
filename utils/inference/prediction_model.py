"""The model predict.py works with: loaded from its checkpoint with the preparation it records, and its export."""

from __future__ import annotations

import logging

from unet import UNet
from utils.checkpoint import model as model_spec
from utils.errors import CheckpointError
from utils.inference.config import DEFAULT_MASK_THRESHOLD, PredictConfig
from utils.inference.export import checkpoint_preprocessing, export_model
from utils.inference.outputs import check_mask_values, default_mask_values
from utils.output_files import check_outputs

logger = logging.getLogger("predict")


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
