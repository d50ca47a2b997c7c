"""dataset.bicubic_resize is torchvision's antialiased bicubic resize, bit for bit, without torchvision."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torchvision.transforms.v2.functional as TF

from tests.conftest import REPO_ROOT
from utils.datasets.dataset import bicubic_resize


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.int16])
@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("layout", ["chw", "hwc view"])
@pytest.mark.parametrize(("size", "new_size"), [((64, 96), (32, 48)), ((37, 53), (18, 26)), ((20, 30), (41, 59))])
def test_the_same_pixels_as_torchvision(dtype, channels, layout, size, new_size) -> None:
    generator = torch.Generator().manual_seed(channels * 1000 + size[0])
    height, width = size
    if dtype == torch.float32:
        pixels = torch.rand(height, width, channels, generator=generator)
    else:
        pixels = torch.randint(0, 256, (height, width, channels), generator=generator).to(dtype)
    # The dataset's tensors are [C, H, W] views of decoded [H, W, C] memory; contiguous [C, H, W] happens too.
    tensor = pixels.permute(2, 0, 1) if layout == "hwc view" else pixels.permute(2, 0, 1).contiguous()
    expected = TF.resize(tensor, list(new_size), interpolation=TF.InterpolationMode.BICUBIC, antialias=True)
    resized = bicubic_resize(tensor, *new_size)
    assert resized.dtype == expected.dtype and torch.equal(resized, expected)


def test_preparing_an_image_imports_no_torchvision() -> None:
    code = (
        "import sys; from PIL import Image; from utils.datasets.dataset import image_tensor; "
        "image_tensor(Image.new('RGB', (40, 30)), 0.5); print('torchvision' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
