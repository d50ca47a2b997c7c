"""Test-time augmentation: the logits of the image and its three flips, flipped back and averaged (4 passes)."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from torch import nn

import predict
from tests.helpers import make_model, read_classes, save_checkpoint, write_images
from utils.inference.tiling import TTA_FLIPS, forward_logits


class _PositionBias(nn.Module):
    """Adds a fixed, asymmetric map to its input and counts its calls: flips change its output, as in a real model."""

    def __init__(self, height: int, width: int) -> None:
        super().__init__()
        self.bias = torch.arange(height * width, dtype=torch.float32).reshape(1, 1, height, width)
        self.calls = 0

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return images + self.bias


def test_tta_averages_the_four_flips_flipped_back():
    model = _PositionBias(5, 7)
    images = torch.rand(2, 3, 5, 7)
    averaged = forward_logits(model, images, "fp32", tta=True)
    assert model.calls == len(TTA_FLIPS) == 4
    bias = model.bias
    expected = images + (bias + bias.flip(3) + bias.flip(2) + bias.flip((2, 3))) / 4
    torch.testing.assert_close(averaged, expected)
    # Without --tta: one pass, the model's own output.
    torch.testing.assert_close(forward_logits(model, images, "fp32"), images + bias)


def test_predict_tta_flag_changes_the_logits_but_keeps_most_pixels(tmp_path):
    [image] = write_images(tmp_path / "in", [(64, 48)])
    checkpoint = save_checkpoint(tmp_path / "m.pth", make_model(2), [0, 1])
    plain, tta = tmp_path / "plain.png", tmp_path / "tta.png"
    common = ["-m", str(checkpoint), "-i", str(image), "-s", "1", "--workers", "0", "--no-progress"]
    assert predict.main([*common, "-o", str(plain)]) == 0
    assert predict.main([*common, "-o", str(tta), "--tta"]) == 0
    plain_classes, tta_classes = read_classes(plain, [0, 1]), read_classes(tta, [0, 1])
    assert Image.open(tta).size == (64, 48)
    agreement = (plain_classes == tta_classes).mean()
    assert 0.5 < agreement < 1.0, agreement  # an untrained model is not flip-invariant: the flag really ran
    assert np.isin(tta_classes, [0, 1]).all()
