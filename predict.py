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
    from utils.launch.signals import stop_quietly_while_starting

    stop_quietly_while_starting()

import logging  # noqa: E402 - after the start-up handler above, as every import below
import sys
from collections.abc import Sequence

import torch

from unet import UNet
from utils.errors import count
from utils.inference.config import PredictConfig, parse_inference_config
from utils.inference.engine import PredictionInputs, load_predictor, predict_items
from utils.inference.export import Preprocessing, export_model
from utils.inference.file_plan import collect_inputs, plan_outputs, prediction_reads
from utils.inference.writer import prediction_summary, write_predictions
from utils.launch.process_group import run_single_process
from utils.output_files import check_outputs

__all__ = ["PARTIAL_FAILURE_EXIT_CODE", "PredictConfig", "main", "predict_files", "run"]

logger = logging.getLogger("predict")

PARTIAL_FAILURE_EXIT_CODE = 1
OOM_FIX = "lower --batch-size, or use --tile 512 (or smaller) for large images"


def predict_files(model: UNet, preprocessing: Preprocessing, config: PredictConfig, device: torch.device) -> int:
    """Predict and write every input of ``config`` as the checkpoint's ``preprocessing`` says; the exit status (see
    the module docstring)."""
    inputs = collect_inputs(config.inputs)
    plans = plan_outputs(inputs, config)
    model.to(device)
    predictions = predict_items(model, PredictionInputs(inputs, preprocessing, config), device, config)
    failures = write_predictions(predictions, plans, preprocessing, config)
    if failures:
        logger.error("%d of %s failed (named above)", len(failures), count(len(inputs), "image"))
    folders = {plan.mask.parent for plan in plans}
    written = len(inputs) - len(failures)
    logger.info(
        "%s", prediction_summary(written, len(inputs), masks=not config.no_save, viz=config.viz, folders=folders)
    )
    return PARTIAL_FAILURE_EXIT_CODE if failures else 0


def run(config: PredictConfig) -> int:
    """Export and/or predict as ``config`` says; returns the exit status (see the module docstring)."""
    device, model, preprocessing = load_predictor(config)
    if config.export_format is not None:
        # The file may replace neither the checkpoint, an input, a training run's file, nor an existing file without
        # --overwrite; it carries the preprocessing record (in an ONNX file's metadata).
        check_outputs(
            [(config.export_path, "--export")],
            prediction_reads(collect_inputs(config.inputs), config),
            writes_images=False,
            replaces_torchscript=config.overwrite and config.export_format == "torchscript",
            overwrite=config.overwrite,
        )
        export_model(model, config.export_format, config.export_path, config.export_size, preprocessing)
        if not config.inputs:
            return 0
    return predict_files(model, preprocessing, config, device)


def main(argv: Sequence[str] | None = None) -> int:
    return run_single_process(
        lambda: run(parse_inference_config(PredictConfig, "predict.py", argv, __doc__)), oom_fix=OOM_FIX
    )


if __name__ == "__main__":
    sys.exit(main())
