"""The flags of ``predict.py`` and ``evaluate.py``: each a typed config whose fields are its flags (``utils.flags``),
checked once, when the command line is parsed.

The flags both scripts share are the fields of ``InferenceConfig``, declared once so they keep one meaning.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

from utils.cli import device_flag, parse_size, stderr_is_terminal
from utils.errors import ConfigError
from utils.flags import FlagParser, flag
from utils.hardware import PRECISIONS, check_workers
from utils.inference.export import EXPORT_FORMATS
from utils.inference.tiling import DEFAULT_TILE_OVERLAP, TileSettings

# Masks must be stored losslessly: a JPEG would blur class values into each other.
MASK_FORMATS = (".png", ".gif", ".bmp", ".tif", ".tiff")
# Probability above which a one-logit model's pixel is foreground (milesial's -t default).
DEFAULT_MASK_THRESHOLD = 0.5
_export_size = partial(parse_size, flag="--export-size")  # (width, height), as export_model takes it


@dataclass
class InferenceConfig:
    """The flags of both scripts: the checkpoint, how its inputs are prepared, and the compute."""

    model: Path = flag(Path("MODEL.pth"), "--model", "-m", metavar="FILE")
    """checkpoint to load (MODEL.pth)"""
    scale: float | None = flag(None, "--scale", "-s", range="(0, 1]")
    """downscaling factor of the images (default: the checkpoint's training scale; 0.5 if it records none)"""
    bilinear: bool = flag(False, "--bilinear")
    """expect bilinear upsampling (the checkpoint decides; a mismatch is an error)"""
    classes: int | None = flag(None, "--classes", "-c", range="[1, inf)")
    """expected number of classes (the checkpoint decides; a mismatch is an error)"""
    batch_size: int = flag(4, "--batch-size", "-b", range="[1, inf)")
    """images per forward pass (4); images of different sizes go into different batches"""
    precision: str = flag("fp32", "--precision", choices=tuple(sorted(PRECISIONS)))
    """forward-pass precision"""
    device: str = flag("auto", "--device", type=device_flag)
    """auto, cpu, cuda, cuda:N or mps (auto: cuda:LOCAL_RANK if there is CUDA, else mps for one process, else cpu)"""
    workers: int = flag(2, "--workers", "-j", range="[0, inf)")
    """worker processes that read and decode the images (2; 0: in the main process)"""
    no_progress: bool = flag(False, "--no-progress")
    """no progress bar (there is none when stderr is not a terminal)"""

    @property
    def progress(self) -> bool:
        return not self.no_progress and stderr_is_terminal()

    def validate(self) -> None:
        """The rules between flags and the machine's bounds (each flag's range is checked as it is parsed)."""
        check_workers(self.workers, "--workers")


@dataclass
class PredictConfig(InferenceConfig):
    """Everything ``predict.py`` needs."""

    inputs: list[str] = flag([], "--input", "-i", metavar="INPUT", nargs="+")
    """image files, folders or glob patterns"""
    outputs: list[Path] | None = flag(None, "--output", "-o", metavar="OUTPUT", nargs="+")
    """output file per input file"""
    output_dir: Path | None = flag(None, "--output-dir", metavar="DIR")
    """write <name>_OUT.png files into DIR"""
    viz: bool = flag(False, "--viz", "-v")
    """write <name>_VIZ.png overlays of the predictions"""
    masks_dir: Path | None = flag(None, "--masks", metavar="DIR")
    """true masks: --viz shows truth | prediction side by side"""
    no_save: bool = flag(False, "--no-save", "-n")
    """do not write the masks (with --viz)"""
    mask_threshold: float = flag(DEFAULT_MASK_THRESHOLD, "--mask-threshold", "-t", range="[0, 1]")
    """probability above which a pixel is foreground (one-logit models; 0.5)"""
    tile: int | None = flag(None, "--tile", metavar="SIZE")
    """sliding-window inference with SIZE x SIZE windows (network pixels, multiple of 16)"""
    tile_overlap: float = flag(DEFAULT_TILE_OVERLAP, "--tile-overlap")
    """fraction shared by neighbouring windows (0.5: nnU-Net's step of half a window)"""
    tta: bool = flag(False, "--tta")
    """average the logits of the image and its flips (4 passes, nnU-Net's TTA)"""
    export: list[str] | None = flag(None, "--export", nargs=2, metavar=("FORMAT", "PATH"))
    """write the model as onnx or torchscript to PATH and check it"""
    export_size: tuple[int, int] = flag((256, 256), "--export-size", metavar="WxH", type=_export_size)
    """sample input size for --export (256x256)"""
    overwrite: bool = flag(False, "--overwrite")
    """let --export replace an existing file (never a checkpoint, an input or a training run's file)"""
    pixel_cache: Path | None = flag(None, "--pixel-cache", metavar="DIR")
    """read the resized inputs from train.py's --pixel-cache DIR (same --scale), filling it on a miss"""

    @property
    def export_format(self) -> str | None:
        return self.export[0] if self.export else None

    @property
    def export_path(self) -> Path | None:
        return Path(self.export[1]) if self.export else None

    def validate(self) -> None:
        super().validate()
        if self.export_format is not None and self.export_format not in EXPORT_FORMATS:
            raise ConfigError(f"--export {self.export_format}: choose one of {', '.join(EXPORT_FORMATS)}")
        if not self.inputs and self.export_format is None:
            raise ConfigError("no input given: pass images with --input/-i (or use --export FORMAT PATH)")
        if self.no_save and not self.viz:
            raise ConfigError("--no-save with no --viz would write nothing; drop --no-save or add --viz")
        if self.outputs is not None and self.output_dir is not None:
            raise ConfigError("give either --output/-o (one file per input) or --output-dir, not both")
        for output in self.outputs or []:
            if output.suffix.lower() not in MASK_FORMATS:
                raise ConfigError(f"--output {output}: masks must be lossless, use one of {', '.join(MASK_FORMATS)}")
        if self.masks_dir is not None and not self.masks_dir.is_dir():
            raise ConfigError(f"--masks {self.masks_dir} is not a folder")
        if self.masks_dir is not None and not self.viz:
            raise ConfigError("--masks only feeds the --viz side-by-side view; add --viz")
        self.tile_settings()

    def tile_settings(self) -> TileSettings | None:
        """The ``--tile`` window settings (checked on creation), or None without ``--tile``."""
        return None if self.tile is None else TileSettings(self.tile, self.tile_overlap, self.tta)


@dataclass
class EvaluateConfig(InferenceConfig):
    """Everything ``evaluate.py`` needs."""

    images_dir: Path = flag(None, "--imgs", metavar="DIR", required=True)
    """folder of images"""
    masks_dir: Path = flag(None, "--masks", metavar="DIR", required=True)
    """folder of true masks"""
    json_path: Path | None = flag(None, "--json", metavar="FILE")
    """also write the scores as JSON to FILE"""
    split_path: Path | None = flag(None, "--split", metavar="FILE")
    """score only the validation images of a run's split.json (from --imgs/--masks)"""
    other_split: bool = flag(False, "--other-split")
    """score a --split other than the one the checkpoint records it was trained on (refused without this flag)"""


ConfigT = TypeVar("ConfigT", bound=InferenceConfig)


def parse_inference_config(config_class: type[ConfigT], prog: str, argv: Sequence[str] | None, doc: str) -> ConfigT:
    """``prog``'s flags as a checked ``config_class``; ``doc`` is the script's docstring: its first paragraph is the
    help's summary, its second (the script's command lines) the help's examples."""
    summary, examples = doc.split("\n\n")[:2]
    parser = FlagParser(config_class, prog=prog, description=summary, epilog=f"examples:\n{examples}")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # the examples' lines as they are
    config = parser.parse(argv)
    config.validate()
    return config
