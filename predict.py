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

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from unet import UNet
from utils import model_spec
from utils.cli import parse_size, print_error, setup_logging
from utils.errors import USER_ERROR_EXIT_CODE, CheckpointError, ConfigError, UserError
from utils.hardware import pick_device, warn_if_emulated
from utils.inference.config import PredictConfig
from utils.inference.engine import PredictionInputs, predict_items
from utils.inference.export import EXPORT_FORMATS, export_model
from utils.inference.file_plan import (
    check_no_clashes,
    check_writable,
    collect_inputs,
    files_in,
    plan_outputs,
    prediction_outputs,
)
from utils.inference.flags import add_compute_flags, add_model_check_flags, add_progress_flag, add_scale_flag
from utils.inference.memory import is_allocator_error
from utils.inference.outputs import check_mask_values, default_mask_values
from utils.inference.overlays import class_colours
from utils.inference.tiling import DEFAULT_TILE_OVERLAP
from utils.inference.writer import Writer, write_predictions

__all__ = ["PARTIAL_FAILURE_EXIT_CODE", "PredictConfig", "build_parser", "main", "predict_files", "run"]

logger = logging.getLogger("predict")

PARTIAL_FAILURE_EXIT_CODE = 1


def build_parser() -> argparse.ArgumentParser:
    summary, examples = __doc__.split("\n\n")[:2]
    parser = argparse.ArgumentParser(
        description=summary, epilog=f"examples:\n{examples}", formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", "-m", default="MODEL.pth", metavar="FILE", help="checkpoint to load (MODEL.pth)")
    parser.add_argument(
        "--input", "-i", metavar="INPUT", nargs="+", default=[], help="image files, folders or glob patterns"
    )
    parser.add_argument("--output", "-o", metavar="OUTPUT", nargs="+", help="output file per input file")
    parser.add_argument("--output-dir", metavar="DIR", help="write <name>_OUT.png files into DIR")
    parser.add_argument("--viz", "-v", action="store_true", help="write <name>_VIZ.png overlays of the predictions")
    parser.add_argument("--masks", metavar="DIR", help="true masks: --viz shows truth | prediction side by side")
    parser.add_argument("--no-save", "-n", action="store_true", help="do not write the masks (with --viz)")
    parser.add_argument(
        "--mask-threshold",
        "-t",
        type=float,
        default=0.5,
        help="probability above which a pixel is foreground (one-logit models; 0.5)",
    )
    add_scale_flag(parser)
    add_model_check_flags(parser)
    add_compute_flags(parser, workers_help="image-decoding")
    parser.add_argument(
        "--tile",
        type=int,
        metavar="SIZE",
        help="sliding-window inference with SIZE x SIZE windows (network pixels, multiple of 16)",
    )
    parser.add_argument(
        "--tile-overlap",
        type=float,
        default=DEFAULT_TILE_OVERLAP,
        help="fraction shared by neighbouring windows (0.5: nnU-Net's step of half a window)",
    )
    parser.add_argument(
        "--tta", action="store_true", help="average the logits of the image and its flips (4 passes, nnU-Net's TTA)"
    )
    parser.add_argument(
        "--export",
        nargs=2,
        metavar=("FORMAT", "PATH"),
        help=f"write the model as {' or '.join(EXPORT_FORMATS)} to PATH and check it",
    )
    parser.add_argument("--export-size", default="256x256", metavar="WxH", help="sample input size for --export")
    add_progress_flag(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> PredictConfig:
    export_format, export_path = (args.export[0], Path(args.export[1])) if args.export else (None, None)
    if export_format is not None and export_format not in EXPORT_FORMATS:
        raise ConfigError(f"--export {export_format}: choose one of {', '.join(EXPORT_FORMATS)}")
    width, height = parse_size(args.export_size, "--export-size")
    config = PredictConfig(
        model=Path(args.model),
        inputs=list(args.input),
        outputs=[Path(output) for output in args.output] if args.output else None,
        output_dir=Path(args.output_dir) if args.output_dir else None,
        viz=args.viz,
        masks_dir=Path(args.masks) if args.masks else None,
        no_save=args.no_save,
        mask_threshold=args.mask_threshold,
        scale=args.scale,
        bilinear=args.bilinear,
        classes=args.classes,
        batch_size=args.batch_size,
        precision=args.precision,
        device=args.device,
        workers=args.workers,
        tile=args.tile,
        tile_overlap=args.tile_overlap,
        tta=args.tta,
        export_format=export_format,
        export_path=export_path,
        export_size=(height, width),
        progress=not args.no_progress,
    )
    config.validate()
    return config


def load_model(config: PredictConfig) -> tuple[UNet, list, float]:
    """The checkpoint's model (eval mode, on the CPU), the mask value of each of its classes, and the image scale."""
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
    return model.eval(), mask_values, scale


def export(model: UNet, config: PredictConfig) -> None:
    assert config.export_format is not None and config.export_path is not None
    report = export_model(model, config.export_format, config.export_path, config.export_size)
    report_fields = (report.format, report.path, report.checked_with)
    difference = "n/a" if report.max_abs_difference is None else f"{report.max_abs_difference:.3g}"
    logger.info("Exported %s to %s (checked with %s, max |difference| %s)", *report_fields, difference)


def predict_files(model: UNet, mask_values: list, config: PredictConfig, device: torch.device) -> int:
    """Predict and write every input of ``config``; returns the exit status (see the module docstring).

    ``config.scale`` must be resolved (a number) by now: ``run`` does that from the checkpoint.
    """
    assert config.scale is not None
    inputs = collect_inputs(config.inputs)
    plans = plan_outputs(inputs, config.inputs, config.outputs, config.output_dir)
    check_no_clashes(
        prediction_outputs(inputs, plans, masks=not config.no_save, viz=config.viz), read_paths(inputs, config)
    )
    check_writable({plan.mask.parent for plan in plans})
    model.to(device)
    dataset = PredictionInputs(inputs, config.scale, model.n_channels, keep_original=config.viz)
    colours = class_colours(mask_values, model.n_classes)
    writer = Writer(mask_values, colours, not config.no_save, config.viz, config.masks_dir)
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
    logger.info("Predicted %d of %d images", len(inputs) - len(failures), len(inputs))
    if failures:
        logger.error("%d of %d images failed (named above)", len(failures), len(inputs))
        return PARTIAL_FAILURE_EXIT_CODE
    return 0


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
    model, mask_values, scale = load_model(config)
    config = dataclasses.replace(config, scale=scale)
    if config.export_format is not None:
        assert config.export_path is not None
        check_no_clashes([(config.export_path, "--export")], {config.model: "the checkpoint"})
        export(model, config)
        if not config.inputs:
            return 0
    return predict_files(model, mask_values, config, device)


def main(argv: Sequence[str] | None = None) -> int:
    setup_logging(rank=0, world_size=1)
    try:
        return run(config_from_args(build_parser().parse_args(argv)))
    except UserError as error:
        print_error(error)
        return USER_ERROR_EXIT_CODE
    except torch.cuda.OutOfMemoryError:
        print_error("the GPU ran out of memory; lower --batch-size, or use --tile 512 (or smaller) for large images")
        return USER_ERROR_EXIT_CODE
    except (RuntimeError, MemoryError) as error:
        if not is_allocator_error(error):
            raise
        print_error("out of memory on the CPU; lower --batch-size, or use --tile 512 (or smaller) for large images")
        return USER_ERROR_EXIT_CODE
    except SystemExit as exit_request:  # --help, or argparse's own usage error (status 2)
        return exit_request.code if isinstance(exit_request.code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
