"""Joint image/mask augmentation, the same for a sample whatever process, rank or resume point draws it.

Each call draws its random choices from a private generator seeded by a hash of ``(seed, epoch, index)``, so they
depend only on those three numbers (not on DataLoader workers, ranks or what ran before) and the caller's random state
is left untouched.

Written for speed on a loader worker's single core (a 959x640 item is augmented in a few milliseconds): the crop is
cut from the (uint8) input before anything is converted, resized once, and brightness, contrast and saturation, all
linear in RGB, are composed into one 3x3 matrix and offset applied in one pass (torchvision's ``ColorJitter`` makes
a pass per factor and clamps between them; here values are clamped once, at the end). The mask is resampled by index
gathering, so it keeps exactly its values, whatever its dtype.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# ITU-R 601 luma weights, as torchvision's rgb_to_grayscale.
_LUMA = (0.299, 0.587, 0.114)
# RandomResizedCrop's number of tries before it falls back to a centre crop.
_CROP_TRIES = 10


@dataclass(frozen=True)
class AugmentationConfig:
    """Strength of each random transform; a field set to 0 (or a crop scale of ``(1, 1)``) turns that one off."""

    hflip_probability: float = 0.5
    """Chance of a horizontal flip (vertical flips would put cars on their roofs)."""
    crop_scale: tuple[float, float] = (0.6, 1.0)
    """Range of the crop's area as a fraction of the image; the crop is resized back to the image size."""
    crop_aspect_jitter: float = 1.15
    """The crop's aspect ratio is the image's times a factor in [1/jitter, jitter]."""
    brightness: float = 0.2
    contrast: float = 0.2
    saturation: float = 0.2
    """Colour jitter, applied to the image only (see ``torchvision.transforms.v2.ColorJitter``). No hue jitter: its
    RGB→HSV→RGB round trip costs twice all the other transforms together."""


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """Return a 63-bit seed that depends only on ``(seed, epoch, index)``, identical in every process.

    Python's ``hash`` is salted per process, hence a cryptographic hash of the decimal text.
    """
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class JointAugmentation:
    """Random flip, crop-and-resize and colour jitter of an image and its mask, reproducible per sample."""

    def __init__(self, seed: int = 0, config: AugmentationConfig | None = None) -> None:
        self.seed = seed
        self.config = config if config is not None else AugmentationConfig()

    def __call__(
        self, image: torch.Tensor, mask: torch.Tensor, *, epoch: int, index: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Augment ``image`` ([C, H, W]: uint8, or float in [0, 1]) and ``mask`` ([H, W] or [H, W, C], any dtype).

        Returns the image as float32 in [0, 1] and the mask in its own dtype, both at their input sizes. Geometric
        transforms move both alike; the mask is resampled with nearest neighbours, so it keeps exactly its values.
        """
        height, width = image.shape[-2:]
        generator = torch.Generator().manual_seed(sample_seed(self.seed, epoch, index))
        flip, (top, left, crop_h, crop_w), jitter = self._draw(height, width, generator)
        scale = 1 / 255 if image.dtype == torch.uint8 else 1.0
        # Crop first (a view) and resize the crop in its own dtype, channels last: PyTorch's vectorised uint8
        # bilinear kernel is 15x faster there than float in [C, H, W]. The 1/255 joins the colour matrix below.
        pixels = image[None, :, top : top + crop_h, left : left + crop_w]
        if flip:
            pixels = pixels.flip(-1)
        if (crop_h, crop_w) != (height, width):
            # The crop is never larger than the output, so antialiasing would change nothing.
            pixels = pixels.contiguous(memory_format=torch.channels_last)
            pixels = F.interpolate(pixels, size=(height, width), mode="bilinear", align_corners=False)
        # Back to [C, H, W] in the conversion to float itself: one pass.
        pixels = _colour(pixels[0].to(torch.float32, memory_format=torch.contiguous_format), jitter, scale)
        # Nearest neighbours by index (PyTorch's legacy "nearest": source = floor(target * in / out)).
        rows = torch.div(torch.arange(height) * crop_h, height, rounding_mode="floor") + top
        cols = torch.div(torch.arange(width) * crop_w, width, rounding_mode="floor")
        cols = (left + crop_w - 1 - cols) if flip else (left + cols)
        # numpy's take along one axis at a time: 15x faster than torch.index_select on small integer types.
        out_mask = torch.from_numpy(mask.numpy()[rows.numpy()][:, cols.numpy()])
        return pixels, out_mask

    def _draw(
        self, height: int, width: int, generator: torch.Generator
    ) -> tuple[bool, tuple[int, int, int, int], list[tuple[str, float]]]:
        """One sample's random choices: the flip; the crop box (top, left, height, width), RandomResizedCrop's: an
        area fraction and aspect jitter drawn up to 10 times, else the whole image; the colour jitter, (operation,
        factor) in the order they apply."""
        config = self.config

        def uniform(low: float, high: float) -> float:
            return low + (high - low) * float(torch.rand((), generator=generator))

        flip = float(torch.rand((), generator=generator)) < config.hflip_probability
        crop = (0, 0, height, width)
        if config.crop_scale != (1.0, 1.0):
            area, aspect = height * width, width / height
            log_low = math.log(aspect / config.crop_aspect_jitter)
            log_high = math.log(aspect * config.crop_aspect_jitter)
            for _ in range(_CROP_TRIES):
                target = area * uniform(*config.crop_scale)
                ratio = math.exp(uniform(log_low, log_high))
                crop_w, crop_h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
                if 0 < crop_w <= width and 0 < crop_h <= height:
                    top = int(torch.randint(0, height - crop_h + 1, (), generator=generator))
                    left = int(torch.randint(0, width - crop_w + 1, (), generator=generator))
                    crop = (top, left, crop_h, crop_w)
                    break
        strengths = {"brightness": config.brightness, "contrast": config.contrast, "saturation": config.saturation}
        jitter = [
            (name, uniform(max(0.0, 1 - strength), 1 + strength)) for name, strength in strengths.items() if strength
        ]
        return flip, crop, [jitter[i] for i in torch.randperm(len(jitter), generator=generator).tolist()]


def _colour(pixels: torch.Tensor, jitter: list[tuple[str, float]], scale: float) -> torch.Tensor:
    """Apply ``scale`` and the jitter factors, in order, to [C, H, W] pixels as one affine map per pixel.

    Returns [C, H, W] float32 in [0, 1], contiguous.
    """
    channels, height, width = pixels.shape
    identity = torch.eye(channels, dtype=torch.float64)
    luma = torch.tensor(_LUMA if channels == 3 else [1 / channels] * channels, dtype=torch.float64)
    matrix, offset = identity * scale, torch.zeros(channels, dtype=torch.float64)
    for op, factor in jitter:
        step, shift = identity * factor, torch.zeros(channels, dtype=torch.float64)
        if op == "contrast":
            # Blend with the mean grey level of the image as it is at this point (the mean of an affine map of the
            # pixels is the same map of their mean).
            means = pixels.sum(dim=(1, 2)).to(torch.float64) / (height * width)
            shift = torch.full((channels,), (1 - factor) * float(luma @ (matrix @ means + offset)), dtype=torch.float64)
        elif op == "saturation":
            if channels != 3:
                continue  # a grey image has no saturation
            # Blend each pixel with its own grey level.
            step = step + (1 - factor) * torch.ones(3, 1, dtype=torch.float64) * luma
        matrix, offset = step @ matrix, step @ offset + shift
    if torch.equal(matrix, identity) and not offset.any():
        # Not in place: without crop, flip or conversion, pixels may be the caller's tensor.
        return pixels.clamp(0.0, 1.0)
    # A [C, C] x [C, H*W] product plus the offset: one BLAS call over the whole image.
    flat = torch.addmm(offset.to(torch.float32)[:, None], matrix.to(torch.float32), pixels.reshape(channels, -1))
    return flat.view(channels, height, width).clamp_(0.0, 1.0)
