"""The UNet model package; parameter names match milesial/Pytorch-UNet so its weights load unchanged."""

from .unet_model import UNet, UNetArgs

__all__ = ["UNet", "UNetArgs"]
