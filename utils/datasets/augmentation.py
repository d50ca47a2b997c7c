"""Joint image/mask augmentation, the same for a sample whatever process, rank or resume point draws it.

Each call seeds torch's CPU generator from a hash of ``(seed, epoch, index)`` inside ``torch.random.fork_rng``, so the
random choices depend only on those three numbers (not on DataLoader workers, ranks or what ran before) and the
caller's random state is left untouched.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torchvision import tv_tensors
from torchvision.transforms import v2


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
    """Colour jitter, applied to the image only (see ``torchvision.transforms.v2.ColorJitter``)."""
    hue: float = 0.0
    """Hue jitter, off by default: its RGB→HSV→RGB round trip costs twice all the other transforms together."""


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
        """Augment ``image`` (float [C, H, W] in [0, 1]) and ``mask`` (int64 [H, W]); sizes and dtypes are kept.

        Geometric transforms move both alike; the mask is resampled with nearest neighbours, so it keeps exactly
        its class values.
        """
        transform = self._build(image.shape[-2], image.shape[-1])
        # fork_rng(devices=[]) saves and restores the CPU generator only; seeding default_generator (rather than
        # torch.manual_seed) leaves CUDA's generators alone too.
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(sample_seed(self.seed, epoch, index))
            out_image, out_mask = transform(tv_tensors.Image(image), tv_tensors.Mask(mask))
        return out_image.as_subclass(torch.Tensor), out_mask.as_subclass(torch.Tensor)

    def _build(self, height: int, width: int) -> v2.Compose:
        # Built per call because images in one dataset may differ in size; building is cheap next to running it.
        config = self.config
        aspect = width / height
        transforms: list[v2.Transform] = [v2.RandomHorizontalFlip(p=config.hflip_probability)]
        if config.crop_scale != (1.0, 1.0):
            transforms.append(
                v2.RandomResizedCrop(
                    size=(height, width),
                    scale=config.crop_scale,
                    ratio=(aspect / config.crop_aspect_jitter, aspect * config.crop_aspect_jitter),
                    antialias=True,
                )
            )
        if any((config.brightness, config.contrast, config.saturation, config.hue)):
            # ColorJitter passes masks through untouched: only the image changes colour.
            transforms.append(
                v2.ColorJitter(
                    brightness=config.brightness or None,
                    contrast=config.contrast or None,
                    saturation=config.saturation or None,
                    hue=config.hue or None,
                )
            )
        return v2.Compose(transforms)
