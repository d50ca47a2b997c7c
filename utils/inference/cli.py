"""The command lines of ``predict.py`` and ``evaluate.py``: each parser and the typed config it builds, side by side.

The flags both scripts share are defined once in ``utils.inference.flags``; the configs are ``utils.inference.config``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from utils.cli import parse_size, stderr_is_terminal
from utils.errors import ConfigError
from utils.inference.config import DEFAULT_MASK_THRESHOLD, EvaluateConfig, PredictConfig
from utils.inference.export import EXPORT_FORMATS
from utils.inference.flags import add_compute_flags, add_model_check_flags, add_progress_flag, add_scale_flag
from utils.inference.tiling import DEFAULT_TILE_OVERLAP


def build_predict_parser(doc: str) -> argparse.ArgumentParser:
    """predict.py's parser; ``doc`` is the script's docstring (its summary and examples make the help)."""
    summary, examples = doc.split("\n\n")[:2]
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
        default=DEFAULT_MASK_THRESHOLD,
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
    parser.add_argument(
        "--pixel-cache",
        metavar="DIR",
        help="read the resized inputs from train.py's --pixel-cache DIR (same --scale), filling it on a miss",
    )
    add_progress_flag(parser)
    return parser


def parse_predict_config(argv: Sequence[str] | None, doc: str) -> PredictConfig:
    """predict.py's flags as a validated ``PredictConfig``."""
    args = build_predict_parser(doc).parse_args(argv)
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
        pixel_cache=Path(args.pixel_cache) if args.pixel_cache else None,
        tile=args.tile,
        tile_overlap=args.tile_overlap,
        tta=args.tta,
        export_format=export_format,
        export_path=export_path,
        export_size=(height, width),
        progress=not args.no_progress and stderr_is_terminal(),
    )
    config.validate()
    return config


def build_evaluate_parser(doc: str) -> argparse.ArgumentParser:
    """evaluate.py's parser; ``doc`` is the script's docstring (its first paragraph is the summary)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--model", "-m", default="MODEL.pth", metavar="FILE", help="checkpoint to score (MODEL.pth)")
    parser.add_argument("--imgs", required=True, metavar="DIR", help="folder of images")
    parser.add_argument("--masks", required=True, metavar="DIR", help="folder of true masks")
    add_scale_flag(parser)
    add_compute_flags(parser, workers_help="data-loading")
    parser.add_argument("--json", metavar="FILE", help="also write the scores as JSON to FILE")
    parser.add_argument(
        "--split", metavar="FILE", help="score only the validation images of a run's split.json (from --imgs/--masks)"
    )
    add_model_check_flags(parser)
    add_progress_flag(parser)
    return parser


def parse_evaluate_config(argv: Sequence[str] | None, doc: str) -> EvaluateConfig:
    """evaluate.py's flags as a validated ``EvaluateConfig``."""
    args = build_evaluate_parser(doc).parse_args(argv)
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
        split_path=Path(args.split) if args.split else None,
        bilinear=args.bilinear,
        classes=args.classes,
        progress=not args.no_progress and stderr_is_terminal(),
    )
    config.validate()
    return config
