"""Sliding-window inference: window placement, blending weights, and agreement with whole-image prediction."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from unet import UNet
from utils.errors import ConfigError
from utils.evaluation import run_model
from utils.inference.tiling import DOWNSAMPLING, TileSettings, predict_logits_tiled, span_weight, tile_spans


@pytest.mark.parametrize("length", [16, 47, 64, 65, 96, 130, 200, 333])
@pytest.mark.parametrize(("tile", "overlap"), [(32, 0.0), (32, 0.25), (48, 0.5), (64, 0.25)])
def test_windows_cover_the_axis_start_on_the_pooling_grid_and_overlap(length, tile, overlap):
    spans = tile_spans(length, tile, overlap)
    starts = [start for start, _ in spans]
    assert starts == sorted(set(starts))
    assert spans[0][0] == 0 and spans[-1][1] == length
    for start, end in spans:
        assert start % DOWNSAMPLING == 0
        assert end - start <= max(length, tile + DOWNSAMPLING - 1) and end - start >= min(length, tile)
    for (_, previous_end), (next_start, _) in zip(spans, spans[1:], strict=False):
        # No gap, and at least the requested overlap (rounded down to the grid) between neighbours.
        assert previous_end - next_start >= int(tile * overlap) // DOWNSAMPLING * DOWNSAMPLING


def test_an_axis_no_longer_than_the_window_is_one_window():
    assert tile_spans(40, 64, 0.25) == [(0, 40)]
    assert tile_spans(64, 64, 0.25) == [(0, 64)]
    # Longer by less than the grid step: one window still, since a second could not start on the grid.
    assert tile_spans(75, 64, 0.25) == [(0, 75)]


def test_weights_are_gaussians_centred_on_each_window_with_sigma_an_eighth_of_the_tile():
    sigma = 64 / 8
    for start, end in tile_spans(200, 64, 0.5):
        weight = span_weight(end - start, 64)
        positions = torch.arange(start, end, dtype=torch.float32) + 0.5
        expected = torch.exp(-0.5 * ((positions - (start + end) / 2) / sigma) ** 2).clamp_min(1e-6)
        torch.testing.assert_close(weight, expected)
        # Peak 1 at the centre, ~exp(-8) at the window's edges: the centre, with the most context, decides.
        assert weight.max() == pytest.approx(1.0, abs=0.01) and weight[0] < 1e-3 and bool((weight > 0).all())


def test_default_step_is_half_a_window():
    assert TileSettings(64).overlap == 0.5
    starts = [start for start, _ in tile_spans(320, 64, TileSettings(64).overlap)]
    assert starts == list(range(0, 257, 32))


def test_invalid_tile_settings_name_the_flag():
    with pytest.raises(ConfigError, match="--tile 40"):
        TileSettings(40)
    with pytest.raises(ConfigError, match="--tile-overlap 0.7"):
        TileSettings(64, 0.7)


def _pointwise_model() -> nn.Module:
    # A 1x1 convolution sees one pixel: any correct tiling reproduces it exactly, whatever the windows.
    torch.manual_seed(0)
    return nn.Conv2d(3, 4, kernel_size=1).eval()


@pytest.mark.parametrize("tta", [False, True])
@pytest.mark.parametrize(("size", "tile", "overlap"), [((100, 130), 32, 0.25), ((64, 200), 48, 0.5), ((90, 90), 32, 0)])
def test_stitching_and_blending_reproduce_a_pointwise_model_exactly(size, tile, overlap, tta):
    model = _pointwise_model()
    images = torch.rand(2, 3, *size)
    whole = run_model(model, images, "fp32")
    tiled = predict_logits_tiled(model, images, TileSettings(tile, overlap, tta=tta), "fp32", batch_size=3)
    torch.testing.assert_close(tiled, whole, rtol=1e-5, atol=1e-6)


def _structured_images(height: int, width: int) -> torch.Tensor:
    # Smooth blobs and stripes: a random UNet then gives class maps with real structure instead of noise.
    y, x = torch.meshgrid(torch.linspace(0, 1, height), torch.linspace(0, 1, width), indexing="ij")
    channels = [torch.sin(7 * x + 3 * y), torch.cos(5 * y - 2 * x), ((x - 0.4) ** 2 + (y - 0.6) ** 2 < 0.08).float()]
    return (torch.stack(channels) * 0.5 + 0.5)[None]


@torch.inference_mode()
def test_one_window_covering_the_image_equals_whole_image_prediction_exactly():
    torch.manual_seed(0)
    model = UNet(3, 2, base_channels=8).eval()
    images = _structured_images(64, 80)
    whole = run_model(model, images, "fp32")
    tiled = predict_logits_tiled(model, images, TileSettings(80, 0.25), "fp32", batch_size=2)
    assert torch.equal(tiled, whole)


@torch.inference_mode()
def test_many_windows_agree_with_whole_image_prediction_except_near_ties():
    """A UNet sees ~200 pixels around each output pixel, more than any window margin, so tiling is not exact.

    Worst case on purpose: an untrained model whose bias is set so that half the pixels are each class, i.e. with
    many near-ties. The blended logits stay within a small fraction of the logits' spread, pixels flip only where
    the two classes nearly tie, and blending beats hard-edged windows by far.
    """
    torch.manual_seed(0)
    model = UNet(3, 2, base_channels=8).eval()
    images = _structured_images(160, 224)
    margin = _class_margin(run_model(model, images, "fp32"))
    model.outc.conv.bias[1] -= margin.median()
    whole_logits = run_model(model, images, "fp32")
    whole, margin = whole_logits.argmax(dim=1), _class_margin(whole_logits)
    assert 0.4 < whole.float().mean().item() < 0.6

    tiled_logits = predict_logits_tiled(model, images, TileSettings(96, 0.5), "fp32", batch_size=4)
    error = (_class_margin(tiled_logits) - margin).abs()
    assert error.max() < 0.3 * margin.std()
    agree = tiled_logits.argmax(dim=1) == whole
    assert agree.float().mean().item() >= 0.99
    assert bool(agree[margin.abs() > 0.3 * margin.std()].all())

    # The bounds above are not loose: windows that only touch (no blending) break them by far.
    hard_edges = predict_logits_tiled(model, images, TileSettings(80, 0.0), "fp32", batch_size=4)
    assert (_class_margin(hard_edges) - margin).abs().max() > margin.std()
    assert (hard_edges.argmax(dim=1) == whole).float().mean().item() < 0.99


def _class_margin(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, 1] - logits[:, 0]
