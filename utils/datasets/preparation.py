"""Image and mask preparation shared by the dataset and inference: decode-side conversion and resizing by ``scale``.

Training items (``utils.datasets.dataset``) and the images predict/evaluate feed the model both come from here, so a
model sees at inference exactly the pixels it was trained on.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from utils.datasets.image_files import mode_channels
from utils.datasets.mask_values import MaskValues, mask_array, values_to_classes
from utils.errors import DatasetError


def image_tensor(img: Image.Image, scale: float, channels: int | None = None) -> torch.Tensor:
    """Return an image as float32 [C, H, W] in [0, 1], resized by ``scale`` with antialiased bicubic filtering.

    ``channels`` (1 or 3) converts grey photos to RGB or the reverse; ``None`` keeps the photo's own kind.
    """
    return unit_float(resized_image(img, scale, channels))


def resized_image(img: Image.Image, scale: float, channels: int | None = None) -> torch.Tensor:
    """The image resized by ``scale`` as [C, H, W]: uint8, or float32 in [0, 1] for 16-bit and float images.

    Resizing runs on the uint8 tensor: torchvision's uint8 path is about 3x faster than PIL's and agrees with it
    to within one grey level. The result is a view of [H, W, C] memory (channels last, as decoded and as the pixel
    cache stores it): the augmentation's crop-and-resize runs fastest on that layout, and the conversion to float
    returns to [C, H, W] in the same pass.
    """
    array = _image_array(img, channels)
    tensor = torch.from_numpy(array)
    tensor = tensor.permute(2, 0, 1) if tensor.ndim == 3 else tensor[None]
    height, width = tensor.shape[1:]
    new_width, new_height = scaled_size(width, height, scale)
    if (new_width, new_height) != (width, height):
        tensor = bicubic_resize(tensor, new_height, new_width)
    if tensor.dtype != torch.uint8:
        # Bicubic filtering overshoots at edges; float images must stay within [0, 1].
        tensor = tensor.clamp(0.0, 1.0)
    return tensor.permute(1, 2, 0).contiguous().permute(2, 0, 1)


def mask_classes(img: Image.Image, scale: float, mask_values: MaskValues) -> np.ndarray:
    """Return a mask as int64 [H, W] class indices, resized by ``scale`` with nearest-neighbour sampling."""
    return values_to_classes(resized_mask(img, scale), mask_values)


def resized_mask(img: Image.Image, scale: float) -> np.ndarray:
    """A mask's raw values (``mask_array``) resized by ``scale`` with nearest-neighbour sampling."""
    mask = mask_array(img)
    height, width = mask.shape[:2]
    new_width, new_height = scaled_size(width, height, scale)
    if (new_width, new_height) != (width, height):
        # Same sample points as PIL's NEAREST (pixel centres), but works for every dtype and channel count.
        rows = np.minimum(((np.arange(new_height) + 0.5) * height / new_height).astype(np.intp), height - 1)
        cols = np.minimum(((np.arange(new_width) + 0.5) * width / new_width).astype(np.intp), width - 1)
        mask = mask[rows[:, None], cols[None, :]]
    return mask


def unit_float(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 pixels as float32 in [0, 1] (float pixels pass through as float32)."""
    if pixels.dtype == torch.uint8:
        return pixels.to(torch.float32, memory_format=torch.contiguous_format).div_(255)
    return pixels.to(torch.float32, memory_format=torch.contiguous_format)


def bicubic_resize(tensor: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """A [C, H, W] CPU tensor resized with antialiased bicubic filtering, exactly as torchvision's
    ``transforms.v2.functional.resize(..., BICUBIC, antialias=True)``, which runs the same ``interpolate`` call.

    Called directly because importing torchvision imports ``torch._dynamo`` (through ``torchvision.ops``): seconds
    added to every ``train.py``/``predict.py`` start for a function that is one line of PyTorch. uint8 (resized
    natively, as torchvision does on a CPU) and float32 only; anything else goes through torchvision itself.
    """
    if tensor.dtype not in (torch.uint8, torch.float32) or tensor.device.type != "cpu":
        import torchvision.transforms.v2.functional as TF

        return TF.resize(tensor, [height, width], interpolation=TF.InterpolationMode.BICUBIC, antialias=True)
    channels, old_height, old_width = tensor.shape
    image = tensor.reshape(1, channels, old_height, old_width)
    strides, numel = image.stride(), image.numel()
    if image.is_contiguous(memory_format=torch.channels_last) and numel != strides[0]:
        # torchvision's restride (pytorch/pytorch#68430): a channels-last [1, C, H, W] view gets a channels-last
        # output, which the uint8 kernel needs to avoid a repacking copy.
        image = image.as_strided((1, channels, old_height, old_width), [numel, *strides[1:]])
    resized = F.interpolate(image, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    return resized.reshape(channels, height, width)


def scaled_size(width: int, height: int, scale: float) -> tuple[int, int]:
    """Return ``(int(scale * width), int(scale * height))``, as milesial; a zero side is an error."""
    new_width, new_height = int(scale * width), int(scale * height)
    if new_width <= 0 or new_height <= 0:
        raise DatasetError(f"scale {scale} shrinks a {width}x{height} image to nothing; use a larger --scale")
    return new_width, new_height


def _image_array(img: Image.Image, channels: int | None = None) -> np.ndarray:
    """Return HxW or HxWx3 pixels: uint8, or float32 in [0, 1] for 16-bit and float images.

    ``channels`` converts by mode: a grey photo (any grey mode) to RGB, a colour one (RGB, RGBA, palette, CMYK, ...)
    to grey, as ``PIL.Image.convert`` does.
    """
    if channels is not None and mode_channels(img.mode) != channels:
        if channels == 1:
            return np.array(img.convert("L"))
        grey = _image_array(img)
        return np.ascontiguousarray(np.repeat(grey[:, :, None], 3, axis=2))
    mode = img.mode
    if mode in ("L", "RGB"):
        return np.array(img)  # a writable copy: torch.from_numpy warns on PIL's read-only buffers
    if mode in ("1", "LA"):
        return np.array(img.convert("L"))
    if mode == "F":
        return np.clip(np.array(img, dtype=np.float32), 0.0, 1.0)
    if mode == "I" or mode.startswith("I;16"):
        # 16-bit grey (PNG opens as "I;16" or "I" depending on the Pillow version): full range is 0..65535.
        return np.clip(np.array(img, dtype=np.float32) / 65535.0, 0.0, 1.0)
    return np.array(img.convert("RGB"))
