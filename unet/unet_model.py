"""The UNet model (Ronneberger et al., 2015) with milesial/Pytorch-UNet's parameter names."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .unet_parts import DoubleConv, Down, OutConv, Up

# The smallest side the model runs at: four 2x2 poolings leave a 2x2 bottleneck, so BatchNorm in training mode sees
# at least 4 values per channel even in a batch of one image. (16 px would survive the poolings but leave a 1x1
# bottleneck, on which BatchNorm cannot train a batch of one: "Expected more than 1 value per channel".)
MIN_SIDE = 32


@dataclass(frozen=True)
class UNetArgs:
    """The arguments that build a UNet, the one owner of their names and defaults.

    Checkpoints store them (``model_args``) so inference needs no repeated flags. ``n_channels`` and ``n_classes``
    default to milesial/Pytorch-UNet's hub model (RGB images, two classes); ``UNet`` itself requires them.
    """

    n_channels: int = 3
    n_classes: int = 2
    bilinear: bool = False
    """Bilinear upsampling instead of transposed convolutions (the deepest block is then halved)."""
    base_channels: int = 64
    """Width of the first block; 64 is the classic model."""
    encoder: str = "unet"
    """``unet`` (milesial's encoder) or a torchvision ResNet (``unet.resnet_unet``); files without it are ``unet``."""
    deep_supervision: bool = False
    """Auxiliary 1x1-conv heads at 1/2 and 1/4 resolution, used by training-mode forward passes only."""

    def as_dict(self) -> dict[str, Any]:
        """The arguments as checkpoints store them; ``OPTIONAL_ARGS`` at their defaults are left out, so a plain
        UNet's record stays milesial's four keys, readable by versions that predate the optional ones."""
        args = dataclasses.asdict(self)
        return {key: value for key, value in args.items() if key not in OPTIONAL_ARGS or value != OPTIONAL_ARGS[key]}


# Arguments added after the first checkpoints were written, with the value a file that lacks them means.
OPTIONAL_ARGS: dict[str, Any] = {"encoder": UNetArgs.encoder, "deep_supervision": UNetArgs.deep_supervision}


# Downsampling factor of each auxiliary output, in the order models return them.
AUX_FACTORS = (2, 4)


class AuxiliaryHeads(nn.Module):
    """One 1x1 convolution to ``n_classes`` logits per decoder feature, cropped to the input's extent."""

    def __init__(self, in_channels: Sequence[int], n_classes: int) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(channels, n_classes, kernel_size=1) for channels in in_channels)

    def forward(self, features: Sequence[torch.Tensor], height: int, width: int) -> list[torch.Tensor]:
        """Logits of ``features`` (at 1/2 and 1/4 of a possibly padded input), cropped to the unpadded input's part."""
        outputs = []
        for conv, feature, factor in zip(self.convs, features, AUX_FACTORS, strict=True):
            # Ceil division: the rows that still hold some of the input (padding, if any, lies at the bottom/right).
            outputs.append(conv(feature)[..., : -(-height // factor), : -(-width // factor)])
        return outputs


class SegmentationNet(nn.Module):
    """What both architectures share: the sizes checked, the arguments that rebuild the model, the outputs of
    ``--deep-supervision`` (the subclass creates ``aux_heads``).

    Deep supervision (nnU-Net): extra logits from the decoder stages at 1/2 and 1/4 of the input resolution. The heads
    are 1x1 convolutions used only by training-mode forward passes, which then return ``[logits, logits at 1/2, logits
    at 1/4]``; every such pass uses every head, so DistributedDataParallel finds no unused parameters. Evaluation-mode
    passes (validation, predict, evaluate, export) return the full-resolution logits alone, exactly what a model
    without heads returns. The loss side is ``utils.training.objective.supervised_loss``.
    """

    aux_heads: AuxiliaryHeads | None

    def __init__(self, args: UNetArgs) -> None:
        super().__init__()
        if args.n_channels < 1 or args.n_classes < 1 or args.base_channels < 1:
            raise ValueError(
                f"{type(self).__name__} needs positive sizes, got n_channels={args.n_channels}, "
                f"n_classes={args.n_classes}, base_channels={args.base_channels}"
            )
        self.n_channels = args.n_channels
        self.n_classes = args.n_classes
        self.base_channels = args.base_channels
        self._args = args

    def constructor_args(self) -> dict[str, Any]:
        """The arguments that rebuild this model; stored in checkpoints so inference needs no repeated flags."""
        return self._args.as_dict()

    def _outputs(
        self, logits: torch.Tensor, aux_features: list[torch.Tensor], height: int, width: int
    ) -> torch.Tensor | list[torch.Tensor]:
        """The logits; in training mode with deep supervision ``[logits, logits at 1/2, logits at 1/4]``."""
        if self.aux_heads is None or not self.training:
            return logits
        return [logits, *self.aux_heads(aux_features, height, width)]


class UNet(SegmentationNet):
    """Encoder-decoder segmentation network producing ``n_classes`` logit maps of the input's height and width.

    ``n_classes == 1`` is binary segmentation (one logit, sigmoid); ``n_classes >= 2`` is softmax over classes.
    ``base_channels`` scales the width; 64 reproduces the classic model and its ``state_dict`` exactly.
    """

    def __init__(
        self,
        n_channels: int,
        n_classes: int,
        bilinear: bool = UNetArgs.bilinear,
        base_channels: int = UNetArgs.base_channels,
        deep_supervision: bool = UNetArgs.deep_supervision,
    ) -> None:
        super().__init__(UNetArgs(n_channels, n_classes, bilinear, base_channels, deep_supervision=deep_supervision))
        self.bilinear = bilinear
        self._checkpointing = False

        c = base_channels
        # With bilinear upsampling the deepest block is halved, exactly as in the classic model.
        factor = 2 if bilinear else 1
        self.inc = DoubleConv(n_channels, c)
        self.down1 = Down(c, c * 2)
        self.down2 = Down(c * 2, c * 4)
        self.down3 = Down(c * 4, c * 8)
        self.down4 = Down(c * 8, c * 16 // factor)
        self.up1 = Up(c * 16, c * 8 // factor, bilinear)
        self.up2 = Up(c * 8, c * 4 // factor, bilinear)
        self.up3 = Up(c * 4, c * 2 // factor, bilinear)
        self.up4 = Up(c * 2, c, bilinear)
        self.outc = OutConv(c, n_classes)
        # Created last and only when asked, so a model without them has milesial's state dict, key for key.
        self.aux_heads = AuxiliaryHeads((c * 2 // factor, c * 4 // factor), n_classes) if deep_supervision else None

    def use_checkpointing(self, enabled: bool = True) -> None:
        """Recompute block activations in the backward pass instead of storing them (less memory, more compute)."""
        self._checkpointing = enabled

    def _run(self, block: nn.Module, *inputs: torch.Tensor) -> torch.Tensor:
        if self._checkpointing and self.training and torch.is_grad_enabled():
            # The recomputation in the backward pass runs BatchNorm in training mode a second time; restoring its
            # buffers afterwards keeps running statistics identical to a run without checkpointing.
            return checkpoint(
                block,
                *inputs,
                use_reentrant=False,
                context_fn=lambda: (contextlib.nullcontext(), _preserve_norm_buffers(block)),
            )
        return block(*inputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        height, width = x.shape[-2:]
        # Pad sides under MIN_SIDE (zeros at the bottom/right) and crop the logits back, so any size trains and
        # predicts, a batch of one included, while inputs of 32 pixels or more run exactly as in the classic model.
        pad_bottom, pad_right = max(0, MIN_SIDE - height), max(0, MIN_SIDE - width)
        if pad_bottom or pad_right:
            x = F.pad(x, [0, pad_right, 0, pad_bottom])
        x1 = self._run(self.inc, x)
        x2 = self._run(self.down1, x1)
        x3 = self._run(self.down2, x2)
        x4 = self._run(self.down3, x3)
        x5 = self._run(self.down4, x4)
        x = self._run(self.up1, x5, x4)
        quarter = self._run(self.up2, x, x3)
        half = self._run(self.up3, quarter, x2)
        x = self._run(self.up4, half, x1)
        return self._outputs(self.outc(x)[..., :height, :width], [half, quarter], height, width)


@contextlib.contextmanager
def _preserve_norm_buffers(block: nn.Module) -> Iterator[None]:
    """Snapshot the buffers of ``block`` (its BatchNorm statistics) and put them back when the context exits."""
    buffers = list(block.buffers())
    saved = [buffer.clone() for buffer in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(buffers, saved, strict=True):
                buffer.copy_(value)
