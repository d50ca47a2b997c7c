"""Prediction: the model and its preparation, decoding inputs in loader workers, batching images of equal size,
optional tiling, logits to classes.

``predict_items`` is the loop behind ``predict.py``: images are decoded and resized in ``DataLoader`` workers (so
decoding overlaps the forward passes), grouped into batches of equal network-input size (images of mixed sizes
never get padded, so each prediction is exactly what the model gives for that image alone), run under the chosen
precision, and the logits are resized bilinearly to the original size before the sigmoid threshold or argmax, as in
milesial/Pytorch-UNet's ``predict_img``.

Tiled inference (``TileSettings``, for images too large to run whole) lives in ``utils.inference.tiling``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset
from tqdm import tqdm

from unet import UNet
from utils.checkpoint import model as model_spec
from utils.datasets.dataset import PixelCache, cached_image, image_tensor, resized_image, unit_float
from utils.datasets.image_files import FileInfo, image_header, load_image, mode_channels
from utils.errors import CheckpointError
from utils.evaluation import predict_classes
from utils.hardware import SharedMemoryGuard, guarded_loader, pick_device, warn_if_emulated
from utils.inference.config import DEFAULT_MASK_THRESHOLD, InferenceConfig, PredictConfig
from utils.inference.export import Preprocessing, export_model
from utils.inference.memory import MemoryPlanner
from utils.inference.outputs import check_mask_values, default_mask_values
from utils.inference.tiling import forward_logits, predict_logits_tiled
from utils.output_files import check_outputs

logger = logging.getLogger(__name__)

WORKERS_FIX = "--workers 0 (-j 0)"
"""predict.py's flag that keeps decoding in the main process (see utils.hardware)."""


def open_model(config: InferenceConfig) -> tuple[torch.device, UNet, model_spec.ModelSpec, float]:
    """Where predict.py and evaluate.py start: the device (--device), the checkpoint's model on the CPU (checked
    against --classes/--bilinear), its spec and the image scale (--scale or the checkpoint's)."""
    device = pick_device(config.device)
    warn_if_emulated(device, config.precision)
    model, spec = model_spec.load_model(
        config.model, expected={"n_classes": config.classes, "bilinear": True if config.bilinear else None}
    )
    return device, model, spec, model_spec.resolve_scale(spec, config.scale, config.model)


def load_predictor(config: PredictConfig) -> tuple[torch.device, UNet, Preprocessing]:
    """``open_model``'s device and model (in eval mode), and how predict.py prepares images for it and writes its
    classes: the image scale, the mask value of each class, void values and class names (empty when the checkpoint
    has none)."""
    device, model, spec, scale = open_model(config)
    mask_values, inference = spec.mask_values, spec.inference
    if mask_values is None:
        mask_values = default_mask_values(model.n_classes)
        logger.warning("%s stores no mask_values; writing classes as %s", config.model, mask_values)
    check_mask_values(mask_values)
    void = sorted(set(inference.ignore_values) & {v for v in mask_values if isinstance(v, int)})
    if void:
        # A class written as a void value would read back as "not labelled": never write one.
        raise CheckpointError(
            f"{config.model} maps classes to mask value(s) {void} that it was trained to ignore (--ignore-value); "
            "its mask_values are inconsistent, retrain or fix the checkpoint"
        )
    logger.info("Model %s: %s, mask values %s, scale %s", config.model, model.constructor_args(), mask_values, scale)
    if model.n_classes > 1 and config.mask_threshold != DEFAULT_MASK_THRESHOLD:
        logger.warning(
            "--mask-threshold %s is ignored: %s has %d output classes and each pixel gets its most likely class "
            "(the threshold applies to one-logit models, --classes 1)",
            config.mask_threshold,
            config.model,
            model.n_classes,
        )
    preprocessing = Preprocessing(scale, mask_values, model.n_channels, inference.ignore_values, inference.class_names)
    return device, model.eval(), preprocessing


def run_export(
    model: nn.Module, config: PredictConfig, preprocessing: Preprocessing, protected: dict[Path, str]
) -> None:
    """predict.py's ``--export``: the file may replace neither ``protected`` (the checkpoint, the inputs), a training
    run's file, nor an existing file without ``--overwrite`` (``check_outputs``); it carries ``preprocessing`` (in an
    ONNX file's metadata)."""
    assert config.export_format is not None and config.export_path is not None
    check_outputs(
        [(config.export_path, "--export")],
        protected,
        writes_images=False,
        replaces_torchscript=config.overwrite and config.export_format == "torchscript",
        overwrite=config.overwrite,
    )
    report = export_model(model, config.export_format, config.export_path, config.export_size, preprocessing)
    report_fields = (report.format, report.path, report.checked_with)
    difference = "n/a" if report.max_abs_difference is None else f"{report.max_abs_difference:.3g}"
    logger.info("Exported %s to %s (checked with %s, max |difference| %s)", *report_fields, difference)


@dataclass
class InputItem:
    """One decoded input image, or the reason it could not be decoded, and once predicted its classes."""

    index: int
    path: Path
    image: Tensor | None = None
    """``[C, h, w]`` float32 in [0, 1] at network-input size."""
    original_size: tuple[int, int] = (0, 0)
    """``(height, width)`` of the file's image: predictions are resized back to it."""
    original: Tensor | None = None
    """``[C, H, W]`` uint8 pixels of the file, kept only for visualisation."""
    error: str | None = None
    converted_from: int | None = None
    """The file's channel count when it was converted to the model's (grey photo for an RGB model, or the reverse)."""
    classes: np.ndarray | None = None
    """Class indices ``[H, W]`` at ``original_size`` (``predict_batch``); none when the input could not be read."""


class PredictionInputs(Dataset):
    """Decodes and resizes input files; a file that cannot be used becomes an item with ``error`` set, not a crash.

    A grey photo for an RGB model is converted to RGB, a colour photo for a grey model to grey (PIL's luma), as
    training does; ``predict_items`` warns once with the count of such files. Images are prepared as
    ``preprocessing`` says (scale, channels); ``config`` adds --viz (the full-size pixels are kept), --tile (any size
    is read: PIL's pixel limit is for whole images, --tile holds a window's activations at a time) and --pixel-cache.
    """

    def __init__(self, paths: Sequence[Path], preprocessing: Preprocessing, config: PredictConfig) -> None:
        self.paths = list(paths)
        self.scale, self.n_channels = preprocessing.scale, preprocessing.channels
        self.keep_original, self.any_size = config.viz, config.tile is not None
        # --pixel-cache: the training cache's entries (same scale and channels) are read instead of decoding, and
        # a decoded input is stored for the next run. Not with --viz, which needs the full-size pixels anyway.
        self.pixel_cache = (
            PixelCache(config.pixel_cache, scale=self.scale, channels=self.n_channels)
            if config.pixel_cache is not None and not config.viz and self.n_channels in (1, 3)
            else None
        )
        if self.pixel_cache is not None:
            self.pixel_cache.check_outside(*{path.parent for path in self.paths})
        # The dataset's conversion (grey <-> RGB by PIL mode) exists for 1- and 3-channel models only.
        self._convert_to = self.n_channels if self.n_channels in (1, 3) else None

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> InputItem:
        path = self.paths[index]
        header = original = None  # set when the file is decoded (not on a pixel-cache hit)

        def decode() -> Tensor:
            nonlocal header, original
            with load_image(path, any_size=self.any_size) as pil_image:
                header = pil_image.width, pil_image.height, mode_channels(pil_image.mode)
                if self.keep_original:
                    # Full size for --viz, converted like the model's input (palette, 16-bit, ... handled).
                    original = image_tensor(pil_image, 1.0).mul_(255).round_().to(torch.uint8)
                # The training pipeline's conversion and resize, so predictions see what the model was trained on.
                return resized_image(pil_image, self.scale, self._convert_to)

        try:
            # --pixel-cache: the entry training stored under the file's record (FileInfo.of), else decoded and stored.
            image = cached_image(self.pixel_cache, FileInfo.of(path), decode)
            # On a cache hit the header gives the original size.
            width, height, own_channels = header or image_header(path)
            if image.shape[0] != self.n_channels:
                raise ValueError(f"it has {image.shape[0]} channel(s) but the model expects {self.n_channels}")
        except Exception as error:  # noqa: BLE001 - any decoding failure is reported per file and the run goes on
            return InputItem(index, path, error=f"cannot read image {path}: {str(error) or type(error).__name__}")
        converted_from = own_channels if own_channels != self.n_channels else None
        return InputItem(index, path, unit_float(image), (height, width), original, converted_from=converted_from)


def item_loader(dataset: Dataset, *, batch_size: int, workers: int, pin_memory: bool = False) -> SharedMemoryGuard:
    """predict.py's and evaluate.py's loader (``guarded_loader``): lists of ``batch_size`` items (not stacked:
    images of different sizes cannot be yet), decoded by ``workers`` processes."""
    return guarded_loader(
        dataset,
        batch_size=batch_size,
        workers=workers,
        workers_fix=WORKERS_FIX,
        collate_fn=list,  # the items kept apart; a builtin pickles for workers under any start method
        pin_memory=pin_memory,
    )


class ShapeBuckets:
    """Collects items by image shape and releases full batches, so interleaved sizes still make full batches.

    Nothing is resized or padded. At most ``max_pending`` items wait; beyond that the fullest bucket is released
    early (many distinct sizes would otherwise hold every image in memory). ``shape_of`` tells an item's image shape
    (default: a decoded ``InputItem``'s; ``evaluate.py`` buckets its dataset's dicts).
    """

    def __init__(
        self,
        batch_size: int,
        max_pending: int | None = None,
        shape_of: Callable[[Any], tuple[int, ...]] = lambda item: tuple(item.image.shape),
    ) -> None:
        self.batch_size = batch_size
        self.max_pending = max_pending if max_pending is not None else 4 * batch_size
        self.shape_of = shape_of
        self._buckets: dict[tuple[int, ...], list[Any]] = {}

    def add(self, item: Any) -> list[list[Any]]:
        """Add one decoded item; returns the batches that are ready (possibly none)."""
        shape = self.shape_of(item)
        bucket = self._buckets.setdefault(shape, [])
        bucket.append(item)
        ready = []
        if len(bucket) == self.batch_size:
            ready.append(self._buckets.pop(shape))
        if sum(len(bucket) for bucket in self._buckets.values()) > self.max_pending:
            fullest = max(self._buckets, key=lambda shape: len(self._buckets[shape]))
            ready.append(self._buckets.pop(fullest))
        return ready

    def flush(self) -> list[list[Any]]:
        """All remaining partial batches."""
        ready = list(self._buckets.values())
        self._buckets.clear()
        return ready


def logits_to_classes(logits: Tensor, size: tuple[int, int], threshold: float) -> Tensor:
    """``[K, h, w]`` logits to ``[H, W]`` class indices at ``size``: resize the logits first, then decide (milesial)."""
    resized = F.interpolate(logits[None], size=size, mode="bilinear", align_corners=False)
    return predict_classes(resized, threshold)[0]


@torch.inference_mode()
def predict_batch(
    model: nn.Module,
    items: Sequence[InputItem],
    device: torch.device,
    config: PredictConfig,
    memory: MemoryPlanner | None = None,
) -> list[InputItem]:
    """Predict a batch of items whose network-input images all have the same shape, as ``config`` says (precision,
    threshold, --tta, --tile: windows run --batch-size at a time).

    Without ``--tile``, ``memory`` (when given) decides whether the whole-image pass fits, else which windows to use.
    """
    tile = config.tile_settings()
    if tile is None and memory is not None:
        shape = tuple(items[0].image.shape)  # type: ignore[union-attr] - decoded items only
        tile = memory.tile_if_needed(model, len(items), shape, config.tta, window_batch=config.batch_size)
    images = torch.stack([item.image for item in items]).to(device, non_blocking=True)
    if tile is None:
        logits = forward_logits(model, images, config.precision, config.tta)
    else:
        logits = predict_logits_tiled(model, images, tile, config.precision, config.batch_size)
    predicted = []
    for item, item_logits in zip(items, logits, strict=True):
        classes = logits_to_classes(item_logits, item.original_size, config.mask_threshold)
        predicted.append(replace(item, classes=classes.to(torch.uint8).cpu().numpy()))
    return predicted


def predict_items(
    model: nn.Module,
    dataset: PredictionInputs,
    device: torch.device,
    config: PredictConfig,
    memory: MemoryPlanner | None = None,
) -> Iterator[InputItem]:
    """Yield every input with its ``classes`` (in completion order, not input order); unreadable ones carry ``error``.

    ``config`` gives the batch size, the loader workers, the progress bar and what ``predict_batch`` reads. Without
    ``--tile``, each batch is first checked against ``memory`` (default: the device's free memory); a batch whose
    whole-image pass would not fit runs in windows the planner sizes, with one warning.
    """
    model.eval()
    loader = item_loader(dataset, batch_size=config.batch_size, workers=config.workers)
    buckets = ShapeBuckets(config.batch_size)
    planner = memory if memory is not None else MemoryPlanner(device=device)
    run = functools.partial(predict_batch, model, device=device, config=config, memory=planner)

    def batches() -> Iterator[list[InputItem]]:
        for loaded in loader:
            for item in loaded:
                if item.error is not None:
                    yield [item]
                else:
                    yield from map(run, buckets.add(item))
        yield from map(run, buckets.flush())

    converted: dict[int, int] = {}
    with tqdm(total=len(dataset), desc="Predicting", unit="img", disable=not config.progress) as bar:
        for predicted in batches():
            for item in predicted:
                if item.converted_from is not None:
                    converted[item.converted_from] = converted.get(item.converted_from, 0) + 1
                bar.update(1)
                yield item
    for channels, count in sorted(converted.items()):
        kind, target = ("grey", "RGB") if channels == 1 else ("colour", "grey")
        logger.warning(
            "%d %s image(s) were converted to %s for the %d-channel model", count, kind, target, dataset.n_channels
        )
