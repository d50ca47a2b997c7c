"""Building blocks of the UNet.

Attribute names (``double_conv``, ``maxpool_conv``, ``up``, ``conv``) are part of the checkpoint format: they are the
names milesial/Pytorch-UNet uses, so published weights load without a key mapping. Do not rename them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def conv_bn_relu_twice(in_channels: int, mid_channels: int, out_channels: int) -> nn.Sequential:
    """(3x3 convolution => BatchNorm => ReLU) twice, as one ``Sequential`` (its indices are state-dict keys)."""
    return nn.Sequential(
        nn.Conv2d(in_channels, mid_channels, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(mid_channels),
        nn.ReLU(inplace=True),
        nn.Conv2d(mid_channels, out_channels, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


class DoubleConv(nn.Module):
    """(3x3 convolution => BatchNorm => ReLU) twice."""

    def __init__(self, in_channels: int, out_channels: int, mid_channels: int | None = None) -> None:
        super().__init__()
        self.double_conv = conv_bn_relu_twice(in_channels, mid_channels or out_channels, out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.double_conv(x)


class Down(nn.Module):
    """Halve the resolution with 2x2 max pooling, then DoubleConv."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.maxpool_conv = nn.Sequential(nn.MaxPool2d(2), DoubleConv(in_channels, out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.maxpool_conv(x)


class Up(nn.Module):
    """Double the resolution, concatenate the skip connection, then DoubleConv."""

    def __init__(self, in_channels: int, out_channels: int, bilinear: bool = False) -> None:
        super().__init__()
        if bilinear:
            # Bilinear upsampling has no weights; the convolution reduces channels instead.
            self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
            self.conv = DoubleConv(in_channels, out_channels, in_channels // 2)
        else:
            self.up = nn.ConvTranspose2d(in_channels, in_channels // 2, kernel_size=2, stride=2)
            self.conv = DoubleConv(in_channels, out_channels)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = self.up(x)
        # Odd input sizes lose a row or column to max pooling; pad the upsampled map back to the skip's size so any
        # height and width round-trips to logits of the input's size.
        diff_y = skip.size(2) - x.size(2)
        diff_x = skip.size(3) - x.size(3)
        if diff_y or diff_x:
            x = F.pad(x, [diff_x // 2, diff_x - diff_x // 2, diff_y // 2, diff_y - diff_y // 2])
        return self.conv(torch.cat([skip, x], dim=1))


class OutConv(nn.Module):
    """1x1 convolution to one logit map per class."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)
