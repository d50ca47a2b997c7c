"""dataset.resized_image resizes as torchvision's antialiased bicubic resize, bit for bit, without torchvision."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image

from tests.conftest import REPO_ROOT
from utils.datasets.dataset import resized_image


@pytest.mark.parametrize("mode", ["RGB", "L", "I;16"])  # uint8 colour and grey; 16-bit grey resizes as float32
@pytest.mark.parametrize(("size", "scale"), [((64, 96), 0.5), ((37, 53), 0.5), ((40, 61), 0.3)])
def test_the_same_pixels_as_torchvision(mode: str, size: tuple[int, int], scale: float) -> None:
    generator = np.random.default_rng(size[0])
    height, width = size
    if mode == "I;16":
        array = generator.integers(0, 65536, size=(height, width), dtype=np.uint16)
        pixels = torch.from_numpy(array.astype(np.float32) / 65535.0)[None]
    else:
        shape = (height, width, 3) if mode == "RGB" else (height, width)
        array = generator.integers(0, 256, size=shape, dtype=np.uint8)
        pixels = torch.from_numpy(array).reshape(height, width, -1).permute(2, 0, 1).contiguous()
    image = Image.fromarray(array)
    assert image.mode == mode
    new_size = [int(scale * height), int(scale * width)]
    expected = TF.resize(pixels, new_size, interpolation=TF.InterpolationMode.BICUBIC, antialias=True)
    if mode == "I;16":
        expected = expected.clamp(0.0, 1.0)
    resized = resized_image(image, scale)
    assert resized.dtype == expected.dtype and torch.equal(resized, expected)


def test_preparing_an_image_imports_no_torchvision() -> None:
    code = (
        "import sys; from PIL import Image; from utils.datasets.dataset import image_tensor; "
        "image_tensor(Image.new('RGB', (40, 30)), 0.5); print('torchvision' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
