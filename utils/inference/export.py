"""Exporting a trained model to ONNX or TorchScript, and checking the exported file against PyTorch.

After writing, the file is loaded back (``torch.jit.load``; ``onnxruntime`` for ONNX when it is installed) and run on
the sample input and on a second, larger input; the export fails if either output differs from the PyTorch model's.

Both formats keep the batch size, height and width free, but only for heights and widths that are multiples of 16:
the UNet pads odd-sized feature maps with Python-level branches, which tracing and ``torch.export`` fix to the branch
the sample took. ``predict.py`` resizes with ``--scale``; callers of an exported model should pad inputs to a multiple
of 16 and crop the logits.

``onnx`` and ``onnxscript`` are optional dependencies, needed only for ``--export onnx``.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import logging
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from utils.errors import UserError

logger = logging.getLogger(__name__)

EXPORT_FORMATS = ("onnx", "torchscript")
# Spatial sizes the exported graph supports must be multiples of this (see the module docstring).
SIZE_MULTIPLE = 16
ABSOLUTE_TOLERANCE = 1e-4
RELATIVE_TOLERANCE = 1e-4
ONNX_INSTALL_HINT = "pip install onnx onnxscript"


class ExportError(UserError):
    """The model could not be exported, or the exported file does not reproduce the model."""


@dataclass
class ExportReport:
    """What was written and how it was checked."""

    path: Path
    format: str
    checked_with: str
    """``torch.jit.load``, ``onnxruntime``, or why outputs were not compared."""
    max_abs_difference: float | None
    """Largest difference from PyTorch over the checked inputs; ``None`` when outputs were not compared."""


def export_model(model: nn.Module, export_format: str, path: str | Path, sample_size: tuple[int, int]) -> ExportReport:
    """Write ``model`` in ``export_format`` to ``path`` for ``[N, C, H, W]`` float32 input and check it.

    ``sample_size`` is ``(height, width)`` of the sample input used to trace the model; both must be multiples of 16.
    """
    if export_format not in EXPORT_FORMATS:
        raise ExportError(f"--export {export_format}: choose one of {', '.join(EXPORT_FORMATS)}")
    if any(side < SIZE_MULTIPLE or side % SIZE_MULTIPLE for side in sample_size):
        raise ExportError(f"--export-size {sample_size[1]}x{sample_size[0]}: use multiples of {SIZE_MULTIPLE}")
    path = Path(path)
    # Export a float32 CPU copy in eval mode so the caller's model (maybe on a GPU) is left as it was.
    model = copy.deepcopy(model).float().cpu().eval()
    n_channels = _input_channels(model)
    generator = torch.Generator().manual_seed(0)
    sample = torch.rand(1, n_channels, *sample_size, generator=generator)
    # A second input with another batch size and shape checks that the exported sizes are not frozen to the sample.
    other = torch.rand(
        2, n_channels, sample_size[0] + SIZE_MULTIPLE, sample_size[1] + 2 * SIZE_MULTIPLE, generator=generator
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as error:
        raise ExportError(f"cannot write export file {path}: {error.strerror or error}") from error

    try:
        if export_format == "torchscript":
            return _export_torchscript(model, path, sample, other)
        return _export_onnx(model, path, sample, other)
    except ExportError:
        # A file that failed its check must not be mistaken for a usable export later.
        path.unlink(missing_ok=True)
        raise


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


def _input_channels(model: nn.Module) -> int:
    n_channels = getattr(model, "n_channels", None)
    if isinstance(n_channels, int):
        return n_channels
    first_conv = next(module for module in model.modules() if isinstance(module, nn.Conv2d))
    return first_conv.in_channels


@torch.inference_mode()
def _reference(model: nn.Module, *inputs: Tensor) -> list[Tensor]:
    return [model(x) for x in inputs]


def _compare(path: Path, expected: list[Tensor], actual: list[Tensor]) -> float:
    worst = 0.0
    for reference, exported in zip(expected, actual, strict=True):
        exported = torch.as_tensor(exported)
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
    worst = _compare(path, _reference(model, sample, other), actual)
    return ExportReport(path, "torchscript", "torch.jit.load", worst)


def _export_onnx(model: nn.Module, path: Path, sample: Tensor, other: Tensor) -> ExportReport:
    missing = [name for name in ("onnx", "onnxscript") if importlib.util.find_spec(name) is None]
    if missing:
        raise ExportError(f"--export onnx needs the optional package(s) {', '.join(missing)}: {ONNX_INSTALL_HINT}")
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
                verbose=False,
            )
    except Exception as error:  # noqa: BLE001 - the exporter raises many types; the user needs the one line
        raise ExportError(
            f"ONNX export to {path} failed: {str(error).splitlines()[0] if str(error) else error}"
        ) from error

    if importlib.util.find_spec("onnxruntime") is None:
        import onnx

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
    worst = _compare(path, _reference(model, sample, other), actual)
    return ExportReport(path, "onnx", "onnxruntime", worst)
