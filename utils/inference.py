"""Prediction: decoding inputs in loader workers, batching images of equal size, optional tiling, logits to classes.

``predict_items`` is the loop behind ``predict.py``: images are decoded and resized in ``DataLoader`` workers (so
decoding overlaps the forward passes), grouped into batches of equal network-input size (images of mixed sizes
never get padded, so each prediction is exactly what the model gives for that image alone), run under the chosen
precision, and the logits are resized bilinearly to the original size before the sigmoid threshold or argmax, as in
milesial/Pytorch-UNet's ``predict_img``.

Tiled inference (``TileSettings``) runs a sliding window over the network-input image and blends overlapping windows
with weights that taper linearly across each overlap. How close it is to whole-image prediction, honestly:

* a window that covers the whole image gives exactly the whole-image logits (all weights are 1);
* window starts lie on multiples of 16 (the UNet pools four times by 2), so every window sees the same pooling grid
  as the whole image;
* but a UNet's receptive field is about 200 pixels, more than any window margin, and a window's zero padding
  replaces real context near its edges. Logits therefore differ slightly wherever the window is not the whole
  image; the tapering weights give most say to window centres, where context is most complete. Measured on an
  untrained model with a balanced bias (the worst case: many near-ties), 96-pixel windows with overlap 0.5 keep the
  logits within 0.1-0.2 standard deviations of the whole-image ones and agree on 99.1-99.9% of pixels, every
  flipped pixel a near-tie; windows that merely touch (overlap 0) are off by several standard deviations
  (``tests/test_predict_tiling.py``). A briefly trained model, whose logits are confident, agreed on 99.99%.
  Use tiling for images that do not fit, with windows as large as fit.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from utils.data_loading import image_tensor, load_image
from utils.errors import ConfigError
from utils.evaluation import predict_classes

logger = logging.getLogger(__name__)

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# The UNet pools four times by 2: windows that start on multiples of this see the whole image's pooling grid.
DOWNSAMPLING = 16
MAX_TILE_OVERLAP = 0.5


@dataclass(frozen=True)
class TileSettings:
    """Sliding-window inference for images too large to run whole."""

    size: int
    """Window side in network-input pixels (after ``--scale``); a multiple of 16."""
    overlap: float = 0.25
    """Fraction of the window shared with each neighbour, in [0, 0.5]."""

    def __post_init__(self) -> None:
        if self.size < 2 * DOWNSAMPLING or self.size % DOWNSAMPLING:
            raise ConfigError(f"--tile {self.size}: use a multiple of {DOWNSAMPLING} of at least {2 * DOWNSAMPLING}")
        if not 0.0 <= self.overlap <= MAX_TILE_OVERLAP:
            raise ConfigError(f"--tile-overlap {self.overlap}: use a fraction between 0 and {MAX_TILE_OVERLAP}")


@dataclass
class InputItem:
    """One decoded input image, or the reason it could not be decoded."""

    index: int
    path: Path
    image: Tensor | None = None
    """``[C, h, w]`` float32 in [0, 1] at network-input size."""
    original_size: tuple[int, int] = (0, 0)
    """``(height, width)`` of the file's image: predictions are resized back to it."""
    original: Tensor | None = None
    """``[C, H, W]`` uint8 pixels of the file, kept only for visualisation."""
    error: str | None = None


@dataclass
class Prediction:
    """Class indices ``[H, W]`` for one input at its original size, or why there are none."""

    item: InputItem
    classes: np.ndarray | None = None
    error: str | None = None


class PredictionInputs(Dataset):
    """Decodes and resizes input files; a file that cannot be used becomes an item with ``error`` set, not a crash."""

    def __init__(self, paths: Sequence[Path], scale: float, n_channels: int, keep_original: bool = False) -> None:
        self.paths = list(paths)
        self.scale = scale
        self.n_channels = n_channels
        self.keep_original = keep_original

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> InputItem:
        path = self.paths[index]
        try:
            with load_image(path) as pil_image:
                # The training pipeline's conversion and resize, so predictions see what the model was trained on.
                image = image_tensor(pil_image, self.scale)
                if image.shape[0] != self.n_channels:
                    raise ValueError(f"it has {image.shape[0]} channel(s) but the model expects {self.n_channels}")
                original = _display_pixels(pil_image) if self.keep_original else None
                original_size = (pil_image.height, pil_image.width)
        except Exception as error:  # noqa: BLE001 - any decoding failure is reported per file and the run goes on
            return InputItem(index, path, error=f"cannot read image {path}: {_describe(error)}")
        return InputItem(index, path, image, original_size, original)


def _display_pixels(pil_image) -> Tensor:
    """``[C, H, W]`` uint8 at full size, converted like the model's input (palette, 16-bit, ... handled)."""
    return image_tensor(pil_image, 1.0).mul_(255).round_().to(torch.uint8)


def _describe(error: BaseException) -> str:
    return str(error) or type(error).__name__


def keep_as_list(items: list[InputItem]) -> list[InputItem]:
    """DataLoader collate function: images of different sizes cannot be stacked yet."""
    return items


class ShapeBuckets:
    """Collects items by image shape and releases full batches, so interleaved sizes still make full batches.

    At most ``max_pending`` items wait; beyond that the fullest bucket is released early (many distinct sizes would
    otherwise hold every image in memory).
    """

    def __init__(self, batch_size: int, max_pending: int | None = None) -> None:
        self.batch_size = batch_size
        self.max_pending = max_pending if max_pending is not None else 4 * batch_size
        self._buckets: dict[tuple[int, ...], list[InputItem]] = {}

    def add(self, item: InputItem) -> list[list[InputItem]]:
        """Add one decoded item; returns the batches that are ready (possibly none)."""
        assert item.image is not None
        bucket = self._buckets.setdefault(tuple(item.image.shape), [])
        bucket.append(item)
        ready = []
        if len(bucket) == self.batch_size:
            ready.append(self._buckets.pop(tuple(item.image.shape)))
        if sum(len(bucket) for bucket in self._buckets.values()) > self.max_pending:
            fullest = max(self._buckets, key=lambda shape: len(self._buckets[shape]))
            ready.append(self._buckets.pop(fullest))
        return ready

    def flush(self) -> list[list[InputItem]]:
        """All remaining partial batches."""
        ready = list(self._buckets.values())
        self._buckets.clear()
        return ready


def add_model_check_flags(parser: argparse.ArgumentParser) -> None:
    """``--bilinear``/``--classes``: milesial's model flags, kept for files that do not store the model's arguments."""
    parser.add_argument(
        "--bilinear",
        action="store_true",
        help="expect bilinear upsampling (the checkpoint decides; a mismatch is an error)",
    )
    parser.add_argument(
        "--classes", "-c", type=int, help="expected number of classes (the checkpoint decides; a mismatch is an error)"
    )


def resolve_device(name: str) -> torch.device:
    """``auto``: the GPU when there is one, else the CPU; a GPU that is asked for but absent is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: no CUDA GPU is available here; use --device cpu")
    return device


def warn_if_slow_precision(device: torch.device, precision: str) -> None:
    """Half precision on a CPU without native support is emulated, and far slower than fp32 (measured: ~10x)."""
    if device.type != "cpu" or precision == "fp32":
        return
    probes = (
        ("_is_avx512_bf16_supported", "_is_amx_tile_supported") if precision == "bf16" else ("_is_amx_fp16_supported",)
    )
    native = any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)
    if not native:
        logger.warning(
            "--precision %s on a CPU without native %s instructions is emulated and much slower than fp32; "
            "use --precision fp32 here",
            precision,
            precision,
        )


def autocast_context(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed precision for the forward pass; fp32 runs without autocast."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def tile_spans(length: int, tile: int, overlap: float, align: int = DOWNSAMPLING) -> list[tuple[int, int]]:
    """``[start, end)`` windows along one axis of ``length`` pixels: starts on multiples of ``align``, full coverage.

    Windows are ``tile`` long except the last, which runs to the end (``tile`` to ``tile + align - 1`` long) so that
    it too starts on the grid. Neighbours share at least ``tile * overlap`` pixels, rounded down to the grid.
    """
    last_start = (length - tile) // align * align
    if length <= tile or last_start == 0:
        return [(0, length)]
    stride = max(align, int(tile * (1 - overlap)) // align * align)
    n_windows = math.ceil(last_start / stride) + 1
    # Spread the starts evenly; flooring to the grid keeps every gap at most `stride`, so windows always overlap.
    starts = sorted({(i * last_start) // ((n_windows - 1) * align) * align for i in range(n_windows)})
    return [(start, start + tile) for start in starts[:-1]] + [(last_start, length)]


def span_weights(spans: Sequence[tuple[int, int]]) -> list[Tensor]:
    """Per-window blending weights along one axis: 1 inside, tapering linearly to ~0 across each shared stretch.

    Where two windows overlap their weights sum to 1; weights stay positive, so every pixel has a defined average.
    An edge without a neighbour (the image border) keeps weight 1.
    """
    weights = []
    for index, (start, end) in enumerate(spans):
        positions = torch.arange(start, end, dtype=torch.float32) + 0.5
        weight = torch.ones(end - start)
        if index > 0 and spans[index - 1][1] > start:
            shared = spans[index - 1][1] - start
            weight = torch.minimum(weight, (positions - start) / shared)
        if index + 1 < len(spans) and spans[index + 1][0] < end:
            next_start = spans[index + 1][0]
            weight = torch.minimum(weight, (end - positions) / (end - next_start))
        weights.append(weight)
    return weights


def run_model(model: nn.Module, images: Tensor, precision: str) -> Tensor:
    """Forward pass under ``precision``; logits come back as float32."""
    with autocast_context(images.device, precision):
        logits = model(images)
    return logits.float()


def predict_logits_tiled(
    model: nn.Module, images: Tensor, tile: TileSettings, precision: str, batch_size: int
) -> Tensor:
    """Logits ``[N, K, h, w]`` of ``images`` ``[N, C, h, w]`` from blended sliding windows."""
    _, _, height, width = images.shape
    row_spans, col_spans = tile_spans(height, tile.size, tile.overlap), tile_spans(width, tile.size, tile.overlap)
    row_weights, col_weights = span_weights(row_spans), span_weights(col_spans)
    windows = [
        (image_index, row, col)
        for image_index in range(images.shape[0])
        for row in range(len(row_spans))
        for col in range(len(col_spans))
    ]
    # Windows of one shape are batched together; there are at most four shapes (the last row/column run longer).
    by_shape: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for window in windows:
        (top, bottom), (left, right) = row_spans[window[1]], col_spans[window[2]]
        by_shape.setdefault((bottom - top, right - left), []).append(window)

    weight_sum = torch.zeros(height, width)
    for (top, bottom), row_weight in zip(row_spans, row_weights, strict=True):
        for (left, right), col_weight in zip(col_spans, col_weights, strict=True):
            weight_sum[top:bottom, left:right] += row_weight[:, None] * col_weight[None, :]

    logit_sum: Tensor | None = None
    for group in by_shape.values():
        for chunk_start in range(0, len(group), batch_size):
            chunk = group[chunk_start : chunk_start + batch_size]
            crops = torch.stack([_crop(images[i], row_spans[r], col_spans[c]) for i, r, c in chunk])
            logits = run_model(model, crops, precision)
            if logit_sum is None:
                logit_sum = torch.zeros(images.shape[0], logits.shape[1], height, width, device=images.device)
            for (image_index, row, col), window_logits in zip(chunk, logits, strict=True):
                (top, bottom), (left, right) = row_spans[row], col_spans[col]
                weight = (row_weights[row][:, None] * col_weights[col][None, :]).to(images.device)
                logit_sum[image_index, :, top:bottom, left:right] += window_logits * weight
    assert logit_sum is not None
    return logit_sum / weight_sum.to(images.device)


def _crop(image: Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> Tensor:
    return image[:, rows[0] : rows[1], cols[0] : cols[1]]


def logits_to_classes(logits: Tensor, size: tuple[int, int], threshold: float) -> Tensor:
    """``[K, h, w]`` logits to ``[H, W]`` class indices at ``size``: resize the logits first, then decide (milesial)."""
    resized = F.interpolate(logits[None], size=size, mode="bilinear", align_corners=False)
    return predict_classes(resized, threshold)[0]


@torch.inference_mode()
def predict_batch(
    model: nn.Module,
    items: Sequence[InputItem],
    device: torch.device,
    *,
    precision: str = "fp32",
    threshold: float = 0.5,
    tile: TileSettings | None = None,
    tile_batch_size: int = 4,
) -> list[Prediction]:
    """Predict a batch of items whose network-input images all have the same shape."""
    images = torch.stack([item.image for item in items]).to(device, non_blocking=True)
    if tile is None:
        logits = run_model(model, images, precision)
    else:
        logits = predict_logits_tiled(model, images, tile, precision, tile_batch_size)
    return [
        Prediction(item, logits_to_classes(item_logits, item.original_size, threshold).to(torch.uint8).cpu().numpy())
        for item, item_logits in zip(items, logits, strict=True)
    ]


def predict_items(
    model: nn.Module,
    dataset: PredictionInputs,
    device: torch.device,
    *,
    batch_size: int = 4,
    precision: str = "fp32",
    threshold: float = 0.5,
    tile: TileSettings | None = None,
    workers: int = 0,
    progress: bool = True,
) -> Iterator[Prediction]:
    """Yield one ``Prediction`` per input (in completion order, not input order); failures carry ``error``."""
    model.eval()
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=keep_as_list,
    )
    buckets = ShapeBuckets(batch_size)

    def run(batch: list[InputItem]) -> list[Prediction]:
        return predict_batch(
            model, batch, device, precision=precision, threshold=threshold, tile=tile, tile_batch_size=batch_size
        )

    with tqdm(total=len(dataset), desc="Predicting", unit="img", disable=not progress) as bar:
        for predictions in _run_batches(loader, buckets, run):
            for prediction in predictions:
                bar.update(1)
                yield prediction


def _run_batches(
    loader: Iterable[list[InputItem]],
    buckets: ShapeBuckets,
    run: Callable[[list[InputItem]], list[Prediction]],
) -> Iterator[list[Prediction]]:
    for loaded in loader:
        for item in loaded:
            if item.error is not None:
                yield [Prediction(item, error=item.error)]
                continue
            for batch in buckets.add(item):
                yield run(batch)
    for batch in buckets.flush():
        yield run(batch)
