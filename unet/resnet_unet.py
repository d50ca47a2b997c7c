"""A UNet whose encoder is a torchvision ResNet (``--encoder resnet18|resnet34|resnet50``).

The encoder is ``torchvision.models.resnetXX(weights=None)`` without its pooling and classifier, kept under the
attribute ``encoder`` with torchvision's own parameter names (``encoder.conv1.weight``, ``encoder.layer1.0...``), so a
torchvision state dict (the file torchvision caches, e.g. ``resnet34-b627a593.pth``) loads into it as is. Nothing is
ever downloaded: the weights come from a local file (``utils.training.model.load_encoder_weights``) or from a
checkpoint.

The decoder is segmentation_models.pytorch's UNet decoder: five stages of (2x nearest upsampling, concatenation of the
encoder feature of that resolution, two 3x3 convolution + BatchNorm + ReLU), widths ``4, 2, 1, 1/2, 1/4`` times
``base_channels`` (64 gives SMP's 256, 128, 64, 32, 16).

The model normalises its own input with ImageNet's mean and standard deviation (registered buffers, not in the
state dict): images enter in [0, 1] as for the plain UNet, so predict.py, evaluate.py, export and torch.hub prepare
images exactly as training did with no record beyond the architecture (``encoder`` in the model arguments). The same
normalisation applies to an encoder trained from scratch, so a checkpoint's input convention never depends on where
its first weights came from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchvision import models
from torchvision.models._utils import IntermediateLayerGetter

from .unet_model import AuxiliaryHeads, SegmentationNet, UNetArgs
from .unet_parts import conv_bn_relu_twice

# Channels of the stem (conv1 at 1/2) and of layer1..layer4 (1/4 .. 1/32) of each encoder.
_FEATURE_CHANNELS = {
    "resnet18": (64, 64, 128, 256, 512),
    "resnet34": (64, 64, 128, 256, 512),
    "resnet50": (64, 256, 512, 1024, 2048),
}
# The encoder halves the resolution five times; inputs are padded to a multiple of this and the logits cropped back.
SIZE_MULTIPLE = 32
# torchvision's ImageNet preprocessing (the statistics its pretrained ResNets were trained with).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def input_statistics(n_channels: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std the model normalises with: ImageNet's for 3 channels, else their average per channel
    (a grey or multi-band image has no RGB order to follow)."""
    if n_channels == 3:
        return IMAGENET_MEAN, IMAGENET_STD
    mean, std = sum(IMAGENET_MEAN) / 3, sum(IMAGENET_STD) / 3
    return (mean,) * n_channels, (std,) * n_channels


class DecoderBlock(nn.Module):
    """2x nearest upsampling, concatenation of the skip feature (if any), then (3x3 conv, BatchNorm, ReLU) twice."""

    def __init__(self, in_channels: int, skip_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = conv_bn_relu_twice(in_channels + skip_channels, out_channels, out_channels)

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None) -> torch.Tensor:
        x = F.interpolate(x, scale_factor=2, mode="nearest")
        if skip is not None:
            x = torch.cat([x, skip], dim=1)
        return self.conv(x)


class ResNetUNet(SegmentationNet):
    """A torchvision ResNet encoder (``args.encoder``) under a UNet decoder; ``n_classes`` logit maps of the input's
    height and width.

    With ``deep_supervision``, training-mode forward passes return ``[logits, logits at 1/2, logits at 1/4]`` (see
    ``unet.unet_model.SegmentationNet``); evaluation-mode passes return the logits alone. Activation checkpointing
    (``use_checkpointing``) is the plain UNet's: ``--checkpointing`` with another encoder is refused at parse time.
    """

    def __init__(self, args: UNetArgs) -> None:
        if args.encoder not in _FEATURE_CHANNELS or args.bilinear:
            raise ValueError(
                f"{args} describes no ResNet UNet: its encoder is one of {', '.join(_FEATURE_CHANNELS)}, not bilinear"
            )
        super().__init__(args)
        mean, std = input_statistics(args.n_channels)
        # Not persistent: the values follow from the architecture, so the state dict holds only learnt tensors.
        self.register_buffer("input_mean", torch.tensor(mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("input_std", torch.tensor(std).view(1, -1, 1, 1), persistent=False)

        resnet = getattr(models, args.encoder)(weights=None)
        if args.n_channels != 3:
            resnet.conv1 = nn.Conv2d(args.n_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
        # torchvision's ResNet up to layer4 (no avgpool, fc) under its own names, so its state dict (less fc) loads
        # unchanged; it returns the features at 1/2 (after the stem's ReLU), 1/4, 1/8, 1/16 and 1/32.
        layers = ("relu", "layer1", "layer2", "layer3", "layer4")
        self.encoder = IntermediateLayerGetter(resnet, {name: name for name in layers})
        stem, c1, c2, c3, c4 = _FEATURE_CHANNELS[args.encoder]
        widths = [max(1, args.base_channels * m // 4) for m in (16, 8, 4, 2, 1)]
        # Each stage takes the previous one's output (the deepest feature first) and the skip feature of its scale.
        stages = zip([c4, *widths[:-1]], [c3, c2, c1, stem, 0], widths, strict=True)
        self.decoder = nn.ModuleList(DecoderBlock(previous, skip, width) for previous, skip, width in stages)
        self.head = nn.Conv2d(widths[-1], args.n_classes, kernel_size=1)
        # Auxiliary logits after the decoder stages at 1/2 and 1/4 of the input resolution.
        self.aux_heads = AuxiliaryHeads((widths[3], widths[2]), args.n_classes) if args.deep_supervision else None

    def forward(self, x: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        height, width = x.shape[-2:]
        x = (x - self.input_mean) / self.input_std
        # Zeros after normalisation: the padding looks like an average ImageNet pixel, not like black.
        pad_bottom, pad_right = (-height) % SIZE_MULTIPLE, (-width) % SIZE_MULTIPLE
        x = F.pad(x, [0, pad_right, 0, pad_bottom])
        *features, x = self.encoder(x).values()
        levels = []
        # The deepest feature first; each stage takes the skip feature of its scale (none for the last).
        for block, skip in zip(self.decoder, [*reversed(features), None], strict=True):
            x = block(x, skip)
            levels.append(x)
        return self._outputs(self.head(x)[..., :height, :width], [levels[3], levels[2]], height, width)
