"""Forward passes of prediction: one pass, flips averaged (``--tta``), and sliding windows (``--tile``), as nnU-Net
does them in 2D.

Test-time augmentation: the image, its horizontal flip, its vertical flip and both, each flipped back after the model,
their logits averaged (4 passes). Whole images and windows share ``forward_logits``.

Sliding windows start on multiples of 16 (the UNet pools four times by 2), so every window sees the whole image's
pooling grid; neighbours overlap by half a window by default (nnU-Net's step of 0.5). Each window's logits are
weighted by a Gaussian centred on the window with sigma = window / 8 (nnU-Net's importance map): centres, where the
window holds the most context, count most, and the blended logit is the weighted mean over the windows covering a
pixel.

How close this is to whole-image prediction: a window that covers the whole image gives exactly the whole-image
logits; otherwise a UNet's receptive field (about 200 pixels) exceeds any window margin, so logits differ slightly
near window edges. Measured figures are in docs/INFERENCE.md and ``tests/inference/test_tiling.py``.

Whole image or windows, when ``--tile`` is not given: a UNet's activations grow with the image's area: measured on
the CPU (peak resident memory during one forward pass under ``torch.inference_mode``), about 9-12 float32 values per
pixel per base channel (``ACTIVATION_FLOATS``), plus the input and the logits. Before a whole image runs,
``MemoryPlanner.tile_if_needed`` compares that estimate with the memory free on the device: on CUDA
``torch.cuda.mem_get_info``; on the CPU the smallest of the kernel's ``MemAvailable``, the cgroup's limit and the
address-space limit (``ulimit -v``). When it would not fit, prediction switches to windows of the largest size that
fits, with one warning.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from utils.errors import ConfigError, UserError
from utils.evaluation import run_model
from utils.hardware import memory_bytes

logger = logging.getLogger(__name__)

# Spatial axes of [N, C, H, W] flipped by each test-time pass; () is the image itself.
TTA_FLIPS: tuple[tuple[int, ...], ...] = ((), (3,), (2,), (2, 3))


def forward_logits(model: nn.Module, images: Tensor, precision: str, tta: bool = False) -> Tensor:
    """float32 logits ``[N, K, H, W]`` of ``images``; with ``tta`` the mean over ``TTA_FLIPS``."""
    logits = run_model(model, images, precision)
    for dims in TTA_FLIPS[1:] if tta else ():
        logits += run_model(model, images.flip(dims), precision).flip(dims)
    return logits / len(TTA_FLIPS) if tta else logits


# The UNet pools four times by 2: windows that start on multiples of this see the whole image's pooling grid.
DOWNSAMPLING = 16
"""Also the grid of an exported model's input sizes (``utils.inference.export``)."""
MIN_TILE = 2 * DOWNSAMPLING
MAX_TILE_OVERLAP = 0.5
DEFAULT_TILE_OVERLAP = 0.5
# nnU-Net's importance map: sigma is this fraction of the window side.
GAUSSIAN_SIGMA_SCALE = 1 / 8


@dataclass(frozen=True)
class TileSettings:
    """Sliding-window inference for images too large to run whole."""

    size: int
    """Window side in network-input pixels (after ``--scale``); a multiple of 16."""
    overlap: float = DEFAULT_TILE_OVERLAP
    """Fraction of the window shared with each neighbour, in [0, 0.5]; 0.5 is a step of half a window."""
    tta: bool = False
    """Average each window's logits over its flips (``forward_logits``)."""

    def __post_init__(self) -> None:
        if self.size < MIN_TILE or self.size % DOWNSAMPLING:
            raise ConfigError(f"--tile {self.size}: use a multiple of {DOWNSAMPLING} of at least {MIN_TILE}")
        if not 0.0 <= self.overlap <= MAX_TILE_OVERLAP:
            raise ConfigError(f"--tile-overlap {self.overlap}: use a fraction between 0 and {MAX_TILE_OVERLAP}")


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


def span_weight(length: int, tile: int) -> Tensor:
    """Importance along one axis of a window ``length`` pixels long: a Gaussian centred on the window, sigma =
    ``tile / 8``, peak 1.

    The 2-D weight of a window is the product of its row and column weights (nnU-Net's importance map, which is
    separable). Weights stay positive (at least 1e-6 of the peak), so every pixel has a defined weighted mean.
    """
    offsets = torch.arange(length, dtype=torch.float32) + 0.5 - length / 2  # pixel centres from the window's centre
    return torch.exp(-0.5 * (offsets / (tile * GAUSSIAN_SIGMA_SCALE)) ** 2).clamp_min(1e-6)


def predict_logits_tiled(
    model: nn.Module, images: Tensor, tile: TileSettings, precision: str, batch_size: int
) -> Tensor:
    """Logits ``[N, K, h, w]`` of ``images`` ``[N, C, h, w]`` from Gaussian-blended sliding windows."""
    count, _, height, width = images.shape
    row_spans, col_spans = tile_spans(height, tile.size, tile.overlap), tile_spans(width, tile.size, tile.overlap)
    if len(row_spans) == len(col_spans) == 1:
        # One window is the whole image: its logits, exactly.
        return forward_logits(model, images, precision, tile.tta)
    # Windows of one shape are batched together; there are at most four shapes (the last row/column run longer).
    by_shape: dict[tuple[int, int], list[tuple[int, slice, slice]]] = {}
    for index, (top, bottom), (left, right) in itertools.product(range(count), row_spans, col_spans):
        by_shape.setdefault((bottom - top, right - left), []).append((index, slice(top, bottom), slice(left, right)))
    # The blended logit is the weighted mean: logits times weight, and the weights, summed over the windows.
    logit_sum: Tensor | None = None
    weight_sum = torch.zeros(count, 1, height, width, device=images.device)
    for (window_height, window_width), windows in by_shape.items():
        weight = span_weight(window_height, tile.size)[:, None] * span_weight(window_width, tile.size)[None, :]
        weight = weight.to(images.device)
        for start in range(0, len(windows), batch_size):
            chunk = windows[start : start + batch_size]
            crops = torch.stack([images[index, :, rows, cols] for index, rows, cols in chunk])
            logits = forward_logits(model, crops, precision, tile.tta)
            if logit_sum is None:
                logit_sum = torch.zeros(count, logits.shape[1], height, width, device=images.device)
            for (index, rows, cols), window_logits in zip(chunk, logits, strict=True):
                logit_sum[index, :, rows, cols] += window_logits * weight
                weight_sum[index, :, rows, cols] += weight
    assert logit_sum is not None
    return logit_sum / weight_sum


# float32 activation values alive at the peak of a forward pass, per input pixel and per base channel (measured).
ACTIVATION_FLOATS = 12
BYTES_PER_FLOAT = 4
# Leave this share of the free memory to everything else (allocator slack, decoding, writers).
USABLE_FRACTION = 0.5
GIB = 1024**3


def estimate_forward_bytes(model: nn.Module, batch: int, height: int, width: int, tta: bool = False) -> int:
    """Peak bytes of one forward pass of ``batch`` images of ``height`` x ``width`` network pixels."""
    base_channels = int(getattr(model, "base_channels", 64))
    in_channels, n_classes = int(getattr(model, "n_channels", 3)), int(getattr(model, "n_classes", 2))
    per_pixel = ACTIVATION_FLOATS * base_channels + in_channels + n_classes * (3 if tta else 1)
    return batch * height * width * per_pixel * BYTES_PER_FLOAT


def free_bytes(device: torch.device) -> int | None:
    """Memory a forward pass may still use on ``device``; None where it cannot be told (MPS, other systems)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return memory_bytes(free=True) if device.type == "cpu" else None


@dataclass
class MemoryPlanner:
    """Decides, per batch shape, whether a whole-image pass fits in ``budget_bytes`` or which windows to use."""

    budget_bytes: int | None = None
    """Bytes a forward pass may use; None: read the device's free memory at each decision."""
    device: torch.device | None = None
    """Where the free memory is read when ``budget_bytes`` is None; None as well: unknown, never tile on our own."""
    _warned: bool = field(default=False, init=False)

    def tile_if_needed(
        self, model: nn.Module, batch_shape: Sequence[int], tta: bool, window_batch: int
    ) -> TileSettings | None:
        """None when a batch of ``batch_shape`` ``[N, C, h, w]`` fits whole, else windows that do, run
        ``window_batch`` at a time. The free memory is read now: decoding and earlier batches change it."""
        batch, _, height, width = batch_shape
        needed = estimate_forward_bytes(model, batch, height, width, tta)
        budget = self.budget_bytes
        if budget is None and self.device is not None:
            free = free_bytes(self.device)
            budget = None if free is None else int(free * USABLE_FRACTION)
        if budget is None or needed <= budget:
            return None
        # The tiled pass keeps the blended logits (and weights) of the whole batch besides one batch of windows,
        # which run ``window_batch`` at a time; the last row/column may run up to 15 pixels longer: the largest
        # window whose side plus 16 fits what is left.
        n_classes = int(getattr(model, "n_classes", 2))
        stitched = batch * height * width * (n_classes + 1) * BYTES_PER_FLOAT
        window_pixel_bytes = estimate_forward_bytes(model, window_batch, 1, 1, tta)
        side = math.isqrt(max(0, budget - stitched) // window_pixel_bytes)
        tile = (side - DOWNSAMPLING) // DOWNSAMPLING * DOWNSAMPLING
        available = f"only {budget / GIB:.1f} GiB are free"
        shortage = f"a {width}x{height} image needs about {needed / GIB:.1f} GiB to predict but {available}"
        if tile < MIN_TILE:
            fix = "lower --scale or --batch-size, or free memory"
            raise UserError(f"{shortage}, too little even for --tile {MIN_TILE}; {fix}")
        # Once: every batch of this size would say it again.
        log = logger.debug if self._warned else logger.warning
        log("%s; predicting in %d-pixel windows (pass --tile %d to choose this yourself)", shortage, tile, tile)
        self._warned = True
        return TileSettings(tile, tta=tta)
