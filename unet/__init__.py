"""The UNet model package; parameter names match milesial/Pytorch-UNet so its weights load unchanged."""

from .unet_model import OPTIONAL_ARGS, UNet, UNetArgs, build_model

ENCODERS = ("unet", "resnet18", "resnet34", "resnet50")

__all__ = ["ENCODERS", "OPTIONAL_ARGS", "UNet", "UNetArgs", "build_model"]
