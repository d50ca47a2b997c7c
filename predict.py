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

import sys  # noqa: E402 - after the start-up handler above, as every import below
from collections.abc import Sequence

from utils.inference.config import PredictConfig, parse_inference_config
from utils.inference.engine import PredictionInputs, load_predictor, predict_items
from utils.inference.export import export_model
from utils.inference.writer import collect_inputs, plan_outputs, write_predictions
from utils.launch.process_group import run_single_process

__all__ = ["PARTIAL_FAILURE_EXIT_CODE", "PredictConfig", "main", "run"]

PARTIAL_FAILURE_EXIT_CODE = 1
OOM_FIX = "lower --batch-size, or use --tile 512 (or smaller) for large images"


def run(config: PredictConfig) -> int:
    """Export and/or predict and write every input of ``config`` as the checkpoint says; returns the exit status (see
    the module docstring)."""
    device, model, preprocessing = load_predictor(config)
    inputs = collect_inputs(config.inputs)
    plans = plan_outputs(inputs, config)  # --export's path too: nothing is written before every output is checked
    if config.export_format is not None:
        # The file carries the preprocessing record (in an ONNX file's metadata).
        export_model(model, config.export_format, config.export_path, config.export_size, preprocessing)
        if not inputs:
            return 0
    model.to(device)
    predictions = predict_items(model, PredictionInputs(inputs, preprocessing, config), device, config)
    return PARTIAL_FAILURE_EXIT_CODE if write_predictions(predictions, plans, preprocessing, config) else 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_single_process(
        lambda: run(parse_inference_config(PredictConfig, "predict.py", argv, __doc__)), oom_fix=OOM_FIX
    )


if __name__ == "__main__":
    sys.exit(main())
