"""Predict masks for images with a trained UNet (flags compatible with milesial/Pytorch-UNet's predict.py).

    python predict.py -m checkpoints/best.pth -i data/test/ -o out.png ... | --output-dir preds/
    python predict.py -m MODEL.pth -i 'photos/*.jpg' --viz --masks data/masks/
    python predict.py -m MODEL.pth -i big.tif --tile 512 --precision bf16
    python predict.py -m MODEL.pth --export onnx model.onnx

Masks are written with the dataset's original values (taken from the checkpoint). Exit status: 0 when every image was
predicted, 1 when some images failed (each is named in the log; the others are still written), 2 for a bad flag, model
file or output folder (one ``Error:`` line on stderr).
"""

from __future__ import annotations

import argparse
import glob
import logging
import sys
import tempfile
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from unet import UNet
from utils.checkpoint import build_model_from_checkpoint
from utils.errors import USER_ERROR_EXIT_CODE, ConfigError, UserError
from utils.export import EXPORT_FORMATS, export_model
from utils.image_files import IMAGE_EXTENSIONS
from utils.inference import (
    PRECISIONS,
    Prediction,
    PredictionInputs,
    TileSettings,
    add_model_check_flags,
    predict_items,
    resolve_device,
    warn_if_slow_precision,
)
from utils.mask_output import check_mask_values, default_mask_values, mask_to_image
from utils.run_logging import setup_logging
from utils.visualize import class_colours, find_truth_mask, load_truth_classes, render_visualization

logger = logging.getLogger("predict")

PARTIAL_FAILURE_EXIT_CODE = 1
OUTPUT_SUFFIX = "_OUT"
VIZ_SUFFIX = "_VIZ"
# Masks must be stored losslessly: a JPEG would blur class values into each other.
MASK_FORMATS = (".png", ".gif", ".bmp", ".tif", ".tiff")
# Predictions written at most this many images ahead of the writer threads, to bound memory.
MAX_PENDING_WRITES = 16


@dataclass
class PredictConfig:
    """Everything ``predict.py`` needs, validated once by ``validate``."""

    model: Path = Path("MODEL.pth")
    """Checkpoint: ours, a milesial state_dict with ``mask_values``, or a DDP ``module.``-prefixed one."""
    inputs: list[str] = field(default_factory=list)
    """Image files, folders (their supported images, not recursive) or glob patterns."""
    outputs: list[Path] | None = None
    """One output file per input file; default ``<name>_OUT.png`` beside each input or in ``output_dir``."""
    output_dir: Path | None = None
    viz: bool = False
    """Write ``<name>_VIZ.png``: the prediction over the image (truth | prediction with ``masks_dir``)."""
    masks_dir: Path | None = None
    no_save: bool = False
    mask_threshold: float = 0.5
    scale: float = 0.5
    bilinear: bool = False
    """milesial's flag; the checkpoint decides the architecture, a contradicting flag is an error."""
    classes: int | None = None
    """milesial's flag; the checkpoint decides the architecture, a contradicting flag is an error."""
    batch_size: int = 4
    precision: str = "fp32"
    device: str = "auto"
    workers: int = 2
    tile: int | None = None
    tile_overlap: float = 0.25
    export_format: str | None = None
    export_path: Path | None = None
    export_size: tuple[int, int] = (256, 256)
    """``(height, width)`` of the sample input used for ``--export``."""
    progress: bool = True

    def validate(self) -> None:
        if not self.inputs and self.export_format is None:
            raise ConfigError("no input given: pass images with --input/-i (or use --export FORMAT PATH)")
        if not 0.0 < self.scale <= 1.0:
            raise ConfigError(f"--scale {self.scale}: use a factor in (0, 1]")
        if not 0.0 <= self.mask_threshold <= 1.0:
            raise ConfigError(f"--mask-threshold {self.mask_threshold}: use a probability in [0, 1]")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size {self.batch_size}: use 1 or more")
        if self.workers < 0:
            raise ConfigError(f"--workers {self.workers}: use 0 (decode in the main process) or more")
        if self.classes is not None and self.classes < 1:
            raise ConfigError(f"--classes {self.classes}: use 1 (binary, one logit) or more")
        if self.no_save and not self.viz:
            raise ConfigError("--no-save with no --viz would write nothing; drop --no-save or add --viz")
        if self.outputs is not None and self.output_dir is not None:
            raise ConfigError("give either --output/-o (one file per input) or --output-dir, not both")
        if self.outputs is not None:
            for output in self.outputs:
                if output.suffix.lower() not in MASK_FORMATS:
                    raise ConfigError(
                        f"--output {output}: masks must be lossless, use one of {', '.join(MASK_FORMATS)}"
                    )
        if self.masks_dir is not None and not self.masks_dir.is_dir():
            raise ConfigError(f"--masks {self.masks_dir} is not a folder")
        if self.masks_dir is not None and not self.viz:
            raise ConfigError("--masks only feeds the --viz side-by-side view; add --viz")
        if self.tile is not None:
            TileSettings(self.tile, self.tile_overlap)

    def tile_settings(self) -> TileSettings | None:
        return None if self.tile is None else TileSettings(self.tile, self.tile_overlap)


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
    parser.add_argument("--scale", "-s", type=float, default=0.5, help="downscaling factor of the images (0.5)")
    add_model_check_flags(parser)
    parser.add_argument("--batch-size", "-b", type=int, default=4, help="images per forward pass (4)")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32", help="forward-pass precision")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: cuda when available)")
    parser.add_argument("--workers", "-j", type=int, default=2, help="image-decoding worker processes (2)")
    parser.add_argument(
        "--tile",
        type=int,
        metavar="SIZE",
        help="sliding-window inference with SIZE x SIZE windows (network pixels, multiple of 16)",
    )
    parser.add_argument("--tile-overlap", type=float, default=0.25, help="fraction shared by neighbouring windows")
    parser.add_argument(
        "--export",
        nargs=2,
        metavar=("FORMAT", "PATH"),
        help=f"write the model as {' or '.join(EXPORT_FORMATS)} to PATH and check it",
    )
    parser.add_argument("--export-size", default="256x256", metavar="WxH", help="sample input size for --export")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def config_from_args(args: argparse.Namespace) -> PredictConfig:
    export_format, export_path = (args.export[0], Path(args.export[1])) if args.export else (None, None)
    if export_format is not None and export_format not in EXPORT_FORMATS:
        raise ConfigError(f"--export {export_format}: choose one of {', '.join(EXPORT_FORMATS)}")
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
        export_format=export_format,
        export_path=export_path,
        export_size=_parse_size(args.export_size, "--export-size"),
        progress=not args.no_progress,
    )
    config.validate()
    return config


def _parse_size(text: str, flag: str) -> tuple[int, int]:
    """``"WxH"`` to ``(height, width)``."""
    try:
        width, height = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: write it as WIDTHxHEIGHT, e.g. 256x256") from None
    return height, width


def collect_inputs(patterns: Sequence[str]) -> list[Path]:
    """Expand files, folders and globs into image files (in order, each once).

    Folders and globs skip earlier outputs (``*_OUT.*``, ``*_VIZ.*``), so predicting a folder twice does not predict
    the first run's masks. A missing file, an empty folder or a glob that matches nothing is an error.
    """
    found: list[Path] = []
    for pattern in patterns:
        path = Path(pattern)
        if path.is_file():
            found.append(path)
            continue
        if path.is_dir():
            candidates = sorted(path.iterdir())
        elif glob.has_magic(pattern):
            candidates = sorted(Path(match) for match in glob.glob(pattern))
        else:
            raise ConfigError(f"--input {pattern}: no such file or folder")
        images = [
            candidate
            for candidate in candidates
            if candidate.is_file()
            and candidate.suffix.lower() in IMAGE_EXTENSIONS
            and not candidate.name.startswith(".")
            and not candidate.stem.endswith((OUTPUT_SUFFIX, VIZ_SUFFIX))
        ]
        if not images:
            raise ConfigError(f"--input {pattern}: no images ({', '.join(sorted(IMAGE_EXTENSIONS))}) found there")
        found.extend(images)
    return list(dict.fromkeys(found))


@dataclass(frozen=True)
class OutputPlan:
    """Where one input's mask and visualisation go."""

    mask: Path
    viz: Path


def plan_outputs(inputs: Sequence[Path], config: PredictConfig) -> list[OutputPlan]:
    """Output paths per input; raises ``ConfigError`` on a count mismatch or two inputs writing one file."""
    if config.outputs is not None:
        if not all(Path(pattern).is_file() for pattern in config.inputs):
            raise ConfigError("--output pairs outputs with input files; for folders and globs use --output-dir")
        if len(config.outputs) != len(inputs):
            raise ConfigError(
                f"--output got {len(config.outputs)} paths for {len(inputs)} input images; give one per input file"
            )
        plans = [OutputPlan(out, out.with_name(f"{out.stem}{VIZ_SUFFIX}.png")) for out in config.outputs]
    else:
        plans = []
        for path in inputs:
            folder = config.output_dir if config.output_dir is not None else path.parent
            plans.append(
                OutputPlan(folder / f"{path.stem}{OUTPUT_SUFFIX}.png", folder / f"{path.stem}{VIZ_SUFFIX}.png")
            )
    seen: dict[Path, Path] = {}
    for path, plan in zip(inputs, plans, strict=True):
        for target in (plan.mask, plan.viz):
            key = target.resolve()
            if key in seen:
                raise ConfigError(
                    f"{seen[key]} and {path} would both be written to {target}; rename one or use --output"
                )
            seen[key] = path
        if plan.mask.resolve() == path.resolve():
            raise ConfigError(f"--output {plan.mask} is the input itself; choose another name")
    return plans


def check_writable(folders: set[Path]) -> None:
    """Create the output folders and prove each is writable, so a run never fails after hours of prediction."""
    for folder in sorted(folders):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as error:
            raise ConfigError(
                f"cannot write outputs to {folder}: {error.strerror or error}; choose another --output-dir/--output"
            ) from error


@dataclass
class Writer:
    """Turns predictions into files; runs in writer threads so PNG encoding overlaps the next forward pass."""

    mask_values: list
    colours: list[tuple[int, int, int]]
    save_mask: bool
    save_viz: bool
    masks_dir: Path | None

    def write(self, prediction: Prediction, plan: OutputPlan) -> str | None:
        """Write one prediction's files; returns an error message instead of raising."""
        assert prediction.classes is not None
        try:
            if self.save_mask:
                mask_to_image(prediction.classes, self.mask_values).save(plan.mask)
            if self.save_viz:
                self._write_viz(prediction, plan.viz)
        except (OSError, ValueError, UserError) as error:
            return f"{prediction.item.path}: could not write its output: {error}"
        return None

    def _write_viz(self, prediction: Prediction, path: Path) -> None:
        item = prediction.item
        assert item.original is not None and prediction.classes is not None
        truth = None
        if self.masks_dir is not None:
            truth_path = find_truth_mask(self.masks_dir, item.path)
            if truth_path is None:
                logger.warning(
                    "no true mask for %s in %s; writing the prediction overlay alone", item.path, self.masks_dir
                )
            else:
                truth = load_truth_classes(truth_path, self.mask_values, item.original_size)
        render_visualization(item.original, prediction.classes, self.colours, truth).save(path)


def load_model(config: PredictConfig) -> tuple[UNet, list]:
    """The checkpoint's model (eval mode, on the CPU) and the mask value of each of its classes."""
    model, mask_values = build_model_from_checkpoint(
        config.model, n_classes=config.classes, bilinear=True if config.bilinear else None
    )
    if mask_values is None:
        mask_values = default_mask_values(model.n_classes)
        logger.warning("%s stores no mask_values; writing classes as %s", config.model, mask_values)
    check_mask_values(mask_values, model.n_classes)
    logger.info("Model %s: %s, mask values %s", config.model, model.constructor_args(), mask_values)
    return model.eval(), mask_values


def export(model: UNet, config: PredictConfig) -> None:
    assert config.export_format is not None and config.export_path is not None
    report = export_model(model, config.export_format, config.export_path, config.export_size)
    difference = "n/a" if report.max_abs_difference is None else f"{report.max_abs_difference:.3g}"
    logger.info(
        "Exported %s to %s (checked with %s, max |difference| %s)",
        report.format,
        report.path,
        report.checked_with,
        difference,
    )


def predict_files(model: UNet, mask_values: list, config: PredictConfig, device: torch.device) -> int:
    """Predict and write every input of ``config``; returns the exit status (see the module docstring)."""
    inputs = collect_inputs(config.inputs)
    plans = plan_outputs(inputs, config)
    check_writable({plan.mask.parent for plan in plans})
    model.to(device)
    dataset = PredictionInputs(inputs, config.scale, model.n_channels, keep_original=config.viz)
    colours = class_colours(mask_values, model.n_classes)
    writer = Writer(mask_values, colours, not config.no_save, config.viz, config.masks_dir)
    failures = _predict_and_write(model, dataset, device, config, writer, plans)
    logger.info("Predicted %d of %d images", len(inputs) - len(failures), len(inputs))
    if failures:
        logger.error("%d of %d images failed (named above)", len(failures), len(inputs))
        return PARTIAL_FAILURE_EXIT_CODE
    return 0


def run(config: PredictConfig) -> int:
    """Export and/or predict as ``config`` says; returns the exit status (see the module docstring)."""
    device = resolve_device(config.device)
    warn_if_slow_precision(device, config.precision)
    model, mask_values = load_model(config)
    if config.export_format is not None:
        export(model, config)
        if not config.inputs:
            return 0
    return predict_files(model, mask_values, config, device)


def _predict_and_write(
    model: torch.nn.Module,
    dataset: PredictionInputs,
    device: torch.device,
    config: PredictConfig,
    writer: Writer,
    plans: list[OutputPlan],
) -> list[str]:
    failures: list[str] = []
    pending: deque[Future] = deque()

    def collect(future: Future) -> None:
        message = future.result()
        if message is not None:
            logger.error("%s", message)
            failures.append(message)

    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="predict-writer") as pool:
        for prediction in predict_items(
            model,
            dataset,
            device,
            batch_size=config.batch_size,
            precision=config.precision,
            threshold=config.mask_threshold,
            tile=config.tile_settings(),
            workers=config.workers,
            progress=config.progress,
        ):
            if prediction.error is not None:
                logger.error("%s", prediction.error)
                failures.append(prediction.error)
                continue
            pending.append(pool.submit(writer.write, prediction, plans[prediction.item.index]))
            while len(pending) > MAX_PENDING_WRITES:
                collect(pending.popleft())
        while pending:
            collect(pending.popleft())
    return failures


def main(argv: Sequence[str] | None = None) -> int:
    setup_logging(rank=0, world_size=1)
    try:
        return run(config_from_args(build_parser().parse_args(argv)))
    except UserError as error:
        print(f"Error: {error}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    except torch.cuda.OutOfMemoryError:
        print(
            "Error: the GPU ran out of memory; lower --batch-size, or use --tile SIZE for large images", file=sys.stderr
        )
        return USER_ERROR_EXIT_CODE
    except SystemExit as exit_request:  # --help, or argparse's own usage error (status 2)
        return exit_request.code if isinstance(exit_request.code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
