"""Sliding-window inference: window placement on the UNet's pooling grid and blending of overlapping windows.

Windows blend with weights that taper linearly across each overlap. How close this is to whole-image prediction,
honestly:

* a window that covers the whole image gives exactly the whole-image logits (all weights are 1);
* window starts lie on multiples of 16 (the UNet pools four times by 2), so every window sees the same pooling grid
  as the whole image;
* but a UNet's receptive field is about 200 pixels, more than any window margin, and a window's zero padding
  replaces real context near its edges. Logits therefore differ slightly wherever the window is not the whole
  image; the tapering weights give most say to window centres, where context is most complete. Measured on an
  untrained model with a balanced bias (the worst case: many near-ties), 96-pixel windows with overlap 0.5 keep the
  logits within 0.1-0.2 standard deviations of the whole-image ones and agree on 99.1-99.9% of pixels, every
  flipped pixel a near-tie; windows that merely touch (overlap 0) are off by several standard deviations
  (``tests/inference/test_tiling.py``). A briefly trained model, whose logits are confident, agreed on 99.99%.
  Use tiling for images that do not fit, with windows as large as fit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from utils.errors import ConfigError
from utils.evaluation import run_model

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
