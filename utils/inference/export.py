"""Exporting a trained model to ONNX or TorchScript, and checking the exported file against PyTorch.

After writing, the file is loaded back (``torch.jit.load``; ``onnxruntime`` for ONNX when it is installed) and run on
the sample input and on a second, larger input; the export fails if either output differs from the PyTorch model's.

An ONNX export is one self-contained file that can be copied alone: the weights sit inside it, except for a model
above protobuf's 2 GB limit, whose weights go to ``<file>.data`` beside it (said in one log line: copy both). Its
``metadata_props`` carry the preprocessing record (``Preprocessing``: scale, mask values, channels, void values, class
names, input and output layout), so a runtime without this project can prepare images and read the classes; its
input's dynamic dimensions are named ``batch``, ``height`` and ``width``.

Both formats keep the batch size, height and width free, but only for heights and widths that are multiples of 16:
the UNet pads odd-sized feature maps with Python-level branches, which tracing and ``torch.export`` fix to the branch
the sample took. ``predict.py`` resizes with ``--scale``; callers of an exported model should pad inputs to a multiple
of 16 and crop the logits.

``onnx`` and ``onnxscript`` are optional dependencies, needed only for ``--export onnx``.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from utils.errors import UserError
from utils.inference.tiling import DOWNSAMPLING
from utils.output_files import replacing

logger = logging.getLogger(__name__)

EXPORT_FORMATS = ("onnx", "torchscript")
# Absolute and relative tolerance of the comparison with PyTorch.
TOLERANCE = 1e-4
ONNX_INSTALL_HINT = "pip install onnx onnxscript"
# protobuf cannot serialise a message above 2 GiB: weights above this (which leaves 64 MiB for the graph itself)
# go to a side file.
EXTERNAL_DATA_ABOVE_BYTES = 2**31 - 64 * 2**20
METADATA_PREFIX = "unet_ddp."


class ExportError(UserError):
    """The model could not be exported, or the exported file does not reproduce the model."""


@dataclass(frozen=True)
class Preprocessing:
    """How images must be prepared for the exported model and how its output reads, as the checkpoint records it."""

    scale: float
    """Resize factor of the images (the training ``--scale``)."""
    mask_values: Sequence
    """``mask_values[k]``: the mask value written for class ``k``."""
    channels: int
    ignore_values: Sequence[int] = ()
    """Void mask values of the training data: never a class, never predicted."""
    class_names: Sequence[str] = ()

    def metadata(self) -> dict[str, str]:
        """``metadata_props`` entries: keys prefixed ``unet_ddp.``, values JSON (plain text for the two layouts)."""
        entries = {key: json.dumps(value) for key, value in dataclasses.asdict(self).items()}
        entries["input"] = (
            f"image: float32 [N, {self.channels}, H, W], pixel values / 255 (RGB order for 3 channels), resized by "
            f"scale; H and W multiples of {DOWNSAMPLING} (pad, then crop the logits)"
        )
        entries["output"] = (
            "logits: float32 [N, classes, H, W]; class = argmax over classes (one class: sigmoid > 0.5), written "
            "as mask_values[class]"
        )
        return {f"{METADATA_PREFIX}{key}": value for key, value in entries.items()}


def export_model(
    model: nn.Module,
    export_format: str,
    path: str | Path,
    sample_size: tuple[int, int],
    preprocessing: Preprocessing | None = None,
) -> float | None:
    """Write ``model`` in ``export_format`` to ``path`` for ``[N, C, H, W]`` float32 input, check it and log one line;
    the largest difference from PyTorch over the checked inputs (None when outputs were not compared: ONNX without
    onnxruntime).

    ``sample_size`` is ``(width, height)`` of the sample input used to trace the model (``--export-size WxH``); both
    must be multiples of 16. ``preprocessing`` goes into an ONNX file's ``metadata_props``.
    """
    width, height = sample_size
    if any(side < DOWNSAMPLING or side % DOWNSAMPLING for side in sample_size):
        raise ExportError(f"--export-size {width}x{height}: use multiples of {DOWNSAMPLING}")
    path = Path(path)
    # Export a float32 CPU copy in eval mode so the caller's model (maybe on a GPU) is left as it was.
    model = copy.deepcopy(model).float().cpu().eval()
    n_channels = int(model.n_channels)  # a SegmentationNet (unet), as every model this project builds
    generator = torch.Generator().manual_seed(0)
    sample = torch.rand(1, n_channels, height, width, generator=generator)
    # A second input with another batch size and shape checks that the exported sizes are not frozen to the sample.
    other = torch.rand(2, n_channels, height + DOWNSAMPLING, width + 2 * DOWNSAMPLING, generator=generator)
    # Weights above protobuf's limit go to a side file named (as torch.onnx names it) after the final file.
    weight_bytes = sum(tensor.numel() * 4 for tensor in [*model.parameters(), *model.buffers()])
    big = export_format == "onnx" and weight_bytes > EXTERNAL_DATA_ABOVE_BYTES
    weights_file = path.with_name(path.name + ".data") if big else None
    # Written and checked under a temporary name, then renamed (utils.output_files, which also refuses a folder it
    # cannot write before anything is exported): a file that failed its check is never left to be mistaken for a
    # usable export, and an earlier export at ``path`` stays whole until then. Tracing warns about the padding
    # branches (see above), torch.jit that it is deprecated, the ONNX exporter about its stages: one line is enough.
    try:
        with replacing(path, "--export") as temporary, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if export_format == "torchscript":
                with torch.no_grad():
                    torch.jit.trace(model, sample, check_trace=False).save(str(temporary))
                run, checked_with = torch.jit.load(str(temporary), map_location="cpu"), "torch.jit.load"
            else:
                run, checked_with = _export_onnx(model, temporary, sample, preprocessing, weights_file)
            difference = None if run is None else _compare(path, model, (sample, other), run)
    except BaseException:
        if weights_file is not None:
            weights_file.unlink(missing_ok=True)
        raise
    if weights_file is not None:
        logger.warning(
            "The model is above ONNX's 2 GB file limit: its weights are in %s beside %s; copy both files together",
            weights_file.name,
            path.name,
        )
    shown = "n/a" if difference is None else f"{difference:.3g}"
    logger.info("Exported %s to %s (checked with %s, max |difference| %s)", export_format, path, checked_with, shown)
    return difference


@torch.inference_mode()
def _compare(path: Path, model: nn.Module, inputs: Sequence[Tensor], run: Callable[[Tensor], Tensor]) -> float:
    """The largest difference between the exported model's outputs (``run``) and ``model``'s on ``inputs``; an
    ``ExportError`` when one exceeds the tolerance."""
    worst = 0.0
    for x in inputs:
        reference, exported = model(x), run(x)
        if exported.shape != reference.shape:
            raise ExportError(
                f"exported model {path} returns shape {tuple(exported.shape)}, PyTorch {tuple(reference.shape)}"
            )
        worst = max(worst, float((exported - reference).abs().max()))
        if not torch.allclose(exported, reference, rtol=TOLERANCE, atol=TOLERANCE):
            raise ExportError(f"exported model {path} differs from PyTorch by up to {worst:.3g}; it was deleted")
    return worst


def _export_onnx(
    model: nn.Module, path: Path, sample: Tensor, preprocessing: Preprocessing | None, weights_file: Path | None
) -> tuple[Callable[[Tensor], Tensor] | None, str]:
    """Export to ``path`` (a temporary name), its weights to ``weights_file`` when given (beside it); the file loaded
    back in onnxruntime (None without it: ``onnx.checker`` only) and how it was checked."""
    missing = [name for name in ("onnx", "onnxscript") if importlib.util.find_spec(name) is None]
    if missing:
        raise ExportError(f"--export onnx needs the optional package(s) {', '.join(missing)}: {ONNX_INSTALL_HINT}")
    # The exporter's optimiser logs its passes at INFO; predict.py's one line is enough.
    for name in ("onnxscript", "onnx_ir"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        program = torch.onnx.export(
            model,
            (sample,),
            input_names=["image"],
            output_names=["logits"],
            # Named dimensions (torch.export.Dim.DYNAMIC), so tools show ``batch x 3 x height x width``.
            dynamic_shapes=({0: "batch", 2: "height", 3: "width"},),
            verbose=False,
        )
    except Exception as error:  # noqa: BLE001 - the exporter raises many types; the user needs the one line
        raise ExportError(
            f"ONNX export to {path} failed: {str(error).splitlines()[0] if str(error) else error}"
        ) from error
    import onnx
    import onnx_ir

    if preprocessing is not None:
        program.model.metadata_props.update(preprocessing.metadata())
    onnx_ir.save(program.model, path, external_data=None if weights_file is None else weights_file.name)
    if importlib.util.find_spec("onnxruntime") is None:
        onnx.checker.check_model(str(path))
        logger.warning(
            "onnxruntime is not installed: %s is a valid ONNX graph but its outputs were not compared "
            "with PyTorch (pip install onnxruntime to compare)",
            path,
        )
        return None, "onnx.checker only (onnxruntime not installed)"
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return lambda x: torch.from_numpy(session.run(None, {"image": x.numpy()})[0]), "onnxruntime"
