"""Exporting a trained model to ONNX or TorchScript, and checking the exported file against PyTorch.

After writing, the file is loaded back (``torch.jit.load``; ``onnxruntime`` for ONNX when it is installed) and run on
the sample input and on a second, larger input; the export fails if either output differs from the PyTorch model's.

An ONNX export is one self-contained file that can be copied alone: the weights sit inside it, except for a model
above protobuf's 2 GB limit, whose weights go to ``<file>.data`` beside it (said in one log line: copy both). Its
``metadata_props`` carry the preprocessing record (``Preprocessing``: scale, mask values, channels, void values, class
names, input and output layout), so a runtime without this project can prepare images and read the classes.

Both formats keep the batch size, height and width free, but only for heights and widths that are multiples of 16:
the UNet pads odd-sized feature maps with Python-level branches, which tracing and ``torch.export`` fix to the branch
the sample took. ``predict.py`` resizes with ``--scale``; callers of an exported model should pad inputs to a multiple
of 16 and crop the logits.

``onnx`` and ``onnxscript`` are optional dependencies, needed only for ``--export onnx``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import io
import json
import logging
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from utils.errors import UserError
from utils.inference.tiling import DOWNSAMPLING
from utils.output_files import replacing

logger = logging.getLogger(__name__)

EXPORT_FORMATS = ("onnx", "torchscript")
ABSOLUTE_TOLERANCE = 1e-4
RELATIVE_TOLERANCE = 1e-4
ONNX_INSTALL_HINT = "pip install onnx onnxscript"
# protobuf cannot serialise a message above 2 GiB: larger models keep their weights in a side file.
PROTOBUF_LIMIT_BYTES = 2**31
# Room under the limit for the graph itself (nodes, shapes, names) beside the weights.
PROTOBUF_MARGIN_BYTES = 64 * 2**20
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
        entries = {f"{METADATA_PREFIX}{key}": json.dumps(value) for key, value in dataclasses.asdict(self).items()}
        entries[f"{METADATA_PREFIX}input"] = (
            f"image: float32 [N, {self.channels}, H, W], pixel values / 255 (RGB order for 3 channels), resized by "
            f"scale; H and W multiples of {DOWNSAMPLING} (pad, then crop the logits)"
        )
        entries[f"{METADATA_PREFIX}output"] = (
            "logits: float32 [N, classes, H, W]; class = argmax over classes (one class: sigmoid > 0.5), written "
            "as mask_values[class]"
        )
        return entries


@dataclass
class ExportReport:
    """What was written and how it was checked."""

    path: Path
    format: str
    checked_with: str
    """``torch.jit.load``, ``onnxruntime``, or why outputs were not compared."""
    max_abs_difference: float | None
    """Largest difference from PyTorch over the checked inputs; ``None`` when outputs were not compared."""
    weights_file: Path | None = None
    """For an ONNX model above 2 GB: the file beside ``path`` that holds its weights (copy both)."""


def export_model(
    model: nn.Module,
    export_format: str,
    path: str | Path,
    sample_size: tuple[int, int],
    preprocessing: Preprocessing | None = None,
) -> ExportReport:
    """Write ``model`` in ``export_format`` to ``path`` for ``[N, C, H, W]`` float32 input and check it.

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
    # Written and checked under a temporary name, then renamed (utils.output_files, which also refuses a folder it
    # cannot write before anything is exported): a file that failed its check is never left to be mistaken for a
    # usable export, and an earlier export at ``path`` stays whole until then.
    with replacing(path, "--export") as temporary:
        if export_format == "torchscript":
            report = _export_torchscript(model, temporary, sample, other)
        else:
            report = _export_onnx(model, temporary, sample, other, preprocessing, _weights_file(path))
    report.path = path
    return report


@contextlib.contextmanager
def _quiet_loggers(*names: str) -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in names]
    levels = [each.level for each in loggers]
    for each in loggers:
        each.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for each, level in zip(loggers, levels, strict=True):
            each.setLevel(level)


@torch.inference_mode()
def _compare(path: Path, model: nn.Module, inputs: Sequence[Tensor], actual: Sequence[Tensor]) -> float:
    """The largest difference between the exported model's outputs ``actual`` and ``model``'s on ``inputs``; an
    ``ExportError`` when one exceeds the tolerance."""
    worst = 0.0
    for x, exported in zip(inputs, actual, strict=True):
        reference, exported = model(x), torch.as_tensor(exported)
        if exported.shape != reference.shape:
            raise ExportError(
                f"exported model {path} returns shape {tuple(exported.shape)}, PyTorch {tuple(reference.shape)}"
            )
        difference = (exported - reference).abs()
        worst = max(worst, float(difference.max()))
        allowed = ABSOLUTE_TOLERANCE + RELATIVE_TOLERANCE * reference.abs()
        if bool((difference > allowed).any()):
            raise ExportError(f"exported model {path} differs from PyTorch by up to {worst:.3g}; it was deleted")
    return worst


def _export_torchscript(model: nn.Module, path: Path, sample: Tensor, other: Tensor) -> ExportReport:
    with warnings.catch_warnings():
        # Tracing warns about the padding branches (see the module docstring) and that torch.jit is deprecated.
        warnings.simplefilter("ignore", category=torch.jit.TracerWarning)
        warnings.simplefilter("ignore", category=FutureWarning)
        with torch.no_grad():
            traced = torch.jit.trace(model, sample, check_trace=False)
        traced.save(str(path))
        reloaded = torch.jit.load(str(path), map_location="cpu")
        with torch.inference_mode():
            actual = [reloaded(sample), reloaded(other)]
    return ExportReport(path, "torchscript", "torch.jit.load", _compare(path, model, (sample, other), actual))


def _export_onnx(
    model: nn.Module,
    path: Path,
    sample: Tensor,
    other: Tensor,
    preprocessing: Preprocessing | None,
    weights_file: Path,
) -> ExportReport:
    """Export to ``path`` (a temporary name); ``weights_file`` is where the weights go if the model is above 2 GB."""
    missing = [name for name in ("onnx", "onnxscript") if importlib.util.find_spec(name) is None]
    if missing:
        raise ExportError(f"--export onnx needs the optional package(s) {', '.join(missing)}: {ONNX_INSTALL_HINT}")

    external = needs_external_data(model)
    dynamic = torch.export.Dim.AUTO
    try:
        # The exporter reports each stage on stdout and its optimiser logs at INFO; one summary line is enough.
        with (
            warnings.catch_warnings(),
            _quiet_loggers("onnxscript", "onnx_ir", "torch.onnx"),
            contextlib.redirect_stdout(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            torch.onnx.export(
                model,
                (sample,),
                str(path),
                input_names=["image"],
                output_names=["logits"],
                dynamic_shapes=({0: dynamic, 2: dynamic, 3: dynamic},),
                dynamo=True,
                external_data=external,
                verbose=False,
            )
    except Exception as error:  # noqa: BLE001 - the exporter raises many types; the user needs the one line
        _weights_file(path).unlink(missing_ok=True)
        raise ExportError(
            f"ONNX export to {path} failed: {str(error).splitlines()[0] if str(error) else error}"
        ) from error

    try:
        _write_metadata(path, preprocessing, weights_file if external else None)
        report = _check_onnx(model, path, sample, other)
    except BaseException:
        weights_file.unlink(missing_ok=True)
        raise
    if external:
        report.weights_file = weights_file
        logger.warning(
            "The model is above ONNX's 2 GB file limit: its weights are in %s beside %s; copy both files together",
            weights_file.name,
            weights_file.name.removesuffix(".data"),
        )
    return report


def _write_metadata(path: Path, preprocessing: Preprocessing | None, weights_file: Path | None) -> None:
    """Add the preprocessing record; an export with external data gets its weights under the final file's name."""
    import onnx

    proto = onnx.load(str(path))
    _name_dynamic_dims(proto)
    if preprocessing is not None:
        props = {prop.key: prop.value for prop in proto.metadata_props}
        onnx.helper.set_model_props(proto, {**props, **preprocessing.metadata()})
    if weights_file is None:
        onnx.save(proto, str(path))
        return
    # The exporter named the side file after the temporary name: write it again under the final one.
    onnx.save_model(
        proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=weights_file.name
    )
    _weights_file(path).unlink(missing_ok=True)


DYNAMIC_DIM_NAMES = {0: "batch", 2: "height", 3: "width"}
"""The names the input's dynamic dimensions carry in the file (the exporter generates ``s77``, ``s53``, ...)."""


def _name_dynamic_dims(proto: Any) -> None:
    """Rename the exporter's symbols of the input's batch, height and width everywhere they occur (the output's
    dimensions and intermediate shapes use the same symbols), so tools show ``batch x 3 x height x width``."""
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    renamed = {dims[axis].dim_param: name for axis, name in DYNAMIC_DIM_NAMES.items() if dims[axis].dim_param}
    if not renamed:
        return
    symbol = re.compile(r"\b(" + "|".join(map(re.escape, renamed)) + r")\b")
    for value in [*proto.graph.input, *proto.graph.output, *proto.graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_param = symbol.sub(lambda found: renamed[found.group(1)], dim.dim_param)


def _check_onnx(model: nn.Module, path: Path, sample: Tensor, other: Tensor) -> ExportReport:
    import onnx

    if importlib.util.find_spec("onnxruntime") is None:
        onnx.checker.check_model(str(path))
        logger.warning(
            "onnxruntime is not installed: %s is a valid ONNX graph but its outputs were not compared "
            "with PyTorch (pip install onnxruntime to compare)",
            path,
        )
        return ExportReport(path, "onnx", "onnx.checker only (onnxruntime not installed)", None)

    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    input_name = session.get_inputs()[0].name
    actual = [torch.from_numpy(session.run(None, {input_name: x.numpy()})[0]) for x in (sample, other)]
    return ExportReport(path, "onnx", "onnxruntime", _compare(path, model, (sample, other), actual))


def needs_external_data(model: nn.Module) -> bool:
    """Whether the model's float32 weights and buffers leave too little room under protobuf's limit for one file."""
    size = sum(tensor.numel() * 4 for tensor in [*model.parameters(), *model.buffers()])
    return size > PROTOBUF_LIMIT_BYTES - PROTOBUF_MARGIN_BYTES


def _weights_file(path: Path) -> Path:
    """Where an ONNX model's weights go when they do not fit in it: ``<file>.data`` beside it (torch.onnx's name)."""
    return path.with_name(path.name + ".data")
