"""Which image files a run reads, where each one's outputs go, and whether they can be written there.

The outputs and the files they must not replace are listed here; ``utils.output_files.check_outputs`` compares them
(by file identity) and writes them.
"""

from __future__ import annotations

import glob
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from utils.datasets.image_files import (
    IMAGE_EXTENSIONS,
    OUTPUT_SUFFIX,
    PREDICTION_SUFFIXES,
    VIZ_SUFFIX,
    index_folder,
)
from utils.errors import ConfigError
from utils.output_files import check_outputs

if TYPE_CHECKING:  # utils.inference.config imports MASK_FORMATS from here
    from utils.inference.config import PredictConfig

# Masks must be stored losslessly: a JPEG would blur class values into each other.
MASK_FORMATS = (".png", ".gif", ".bmp", ".tif", ".tiff")


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
            # The one folder index, as train.py's and evaluate.py's: a link loop or a dangling link named like an
            # image is one line naming it, not a file silently left out.
            images = sorted(path / info.name for info in index_folder(path, "input image").values())
        elif glob.has_magic(pattern):
            images = [
                candidate
                for candidate in sorted(Path(match) for match in glob.glob(pattern))
                if candidate.is_file()
                and candidate.suffix.lower() in IMAGE_EXTENSIONS
                and not candidate.name.startswith(".")
                and not candidate.stem.endswith(PREDICTION_SUFFIXES)
            ]
        else:
            raise ConfigError(f"--input {pattern}: no such file or folder")
        if not images:
            raise ConfigError(f"--input {pattern}: no images ({', '.join(sorted(IMAGE_EXTENSIONS))}) found there")
        found.extend(images)
    return list(dict.fromkeys(found))


class OutputPlan(NamedTuple):
    """Where one input's mask and visualisation go."""

    mask: Path
    viz: Path


def plan_outputs(inputs: Sequence[Path], config: PredictConfig) -> list[OutputPlan]:
    """Output paths per input (``inputs`` as ``collect_inputs(config.inputs)`` found them), checked before anything
    runs: ``ConfigError`` on a count mismatch of ``--output``, an output over a file the run reads or must keep, or
    an output folder that cannot be written."""
    if config.outputs is not None:
        if not all(Path(pattern).is_file() for pattern in config.inputs):
            raise ConfigError("--output pairs outputs with input files; for folders and globs use --output-dir")
        if len(config.outputs) != len(inputs):
            raise ConfigError(
                f"--output got {len(config.outputs)} paths for {len(inputs)} input images; give one per input file"
            )
        masks = [(out, out.stem) for out in config.outputs]
    else:
        masks = [((config.output_dir or path.parent) / f"{path.stem}{OUTPUT_SUFFIX}.png", path.stem) for path in inputs]
    # An overlay goes beside its mask: <mask name>_VIZ.png, or <input name>_VIZ.png beside <input name>_OUT.png.
    plans = [OutputPlan(mask, mask.with_name(f"{stem}{VIZ_SUFFIX}.png")) for mask, stem in masks]
    outputs = [
        (output, f"the {role} of {path}")
        for path, plan in zip(inputs, plans, strict=True)
        for output, role, wanted in ((plan.mask, "mask", not config.no_save), (plan.viz, "overlay", config.viz))
        if wanted
    ]
    # The folders a run reads from: each input's (a folder given as an input is its images' folder) and --masks.
    read_from = [path.parent for path in inputs]
    if config.masks_dir is not None:
        read_from.append(config.masks_dir)
    check_outputs(outputs, prediction_reads(inputs, config), read_from)
    # An input's mask and overlay share a folder.
    check_writable({plan.mask.parent for plan in plans})
    return plans


def prediction_reads(inputs: Iterable[Path], config: PredictConfig) -> dict[Path, str]:
    """Every file predict.py reads or must keep: the inputs, the true masks of --viz and the checkpoint."""
    return read_files(config.model, {config.masks_dir: "a true mask in --masks"}, inputs)


def read_files(checkpoint: Path, folders: Mapping[Path | None, str], inputs: Iterable[Path] = ()) -> dict[Path, str]:
    """Every file a run reads or must keep, each with its role, for ``check_outputs``: the checkpoint, each file
    directly in ``folders`` (``{--masks: "a true mask in --masks"}``; None: not given) and the ``inputs``."""
    found: dict[Path, str] = {}
    for folder, role in folders.items():
        if folder is not None and folder.is_dir():
            found.update((path, role) for path in folder.iterdir() if path.is_file())
    found.update((path, "the input") for path in inputs)
    found[checkpoint] = "the checkpoint"
    return found


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
