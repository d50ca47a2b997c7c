"""The UNet model package; parameter names match milesial/Pytorch-UNet so its weights load unchanged."""

from typing import Any

from torch import nn

from .unet_model import OPTIONAL_ARGS, UNet, UNetArgs

ENCODERS = ("unet", "resnet18", "resnet34", "resnet50")

__all__ = ["ENCODERS", "OPTIONAL_ARGS", "UNet", "UNetArgs", "build_model"]


def build_model(args: dict[str, Any]) -> nn.Module:
    """The model ``args`` (``UNetArgs`` names, as checkpoints store them) describe: a UNet or a ResNet-encoder UNet."""
    spec = UNetArgs(**args)
    if spec.encoder == "unet":
        return UNet(spec.n_channels, spec.n_classes, spec.bilinear, spec.base_channels, spec.deep_supervision)
    from .resnet_unet import ResNetUNet  # imports torchvision, which the plain UNet does not need

    return ResNetUNet(spec)
