"""The UNet: milesial-compatible parameter names and shapes, any input size, activation checkpointing."""

from __future__ import annotations

import pytest
import torch

from unet import UNet

# (block prefix, in channels, mid channels, out channels) of every DoubleConv in the classic base-64 model.
TRANSPOSED_BLOCKS = [
    ("inc", 3, 64, 64),
    ("down1.maxpool_conv.1", 64, 128, 128),
    ("down2.maxpool_conv.1", 128, 256, 256),
    ("down3.maxpool_conv.1", 256, 512, 512),
    ("down4.maxpool_conv.1", 512, 1024, 1024),
    ("up1.conv", 1024, 512, 512),
    ("up2.conv", 512, 256, 256),
    ("up3.conv", 256, 128, 128),
    ("up4.conv", 128, 64, 64),
]
BILINEAR_BLOCKS = [
    ("inc", 3, 64, 64),
    ("down1.maxpool_conv.1", 64, 128, 128),
    ("down2.maxpool_conv.1", 128, 256, 256),
    ("down3.maxpool_conv.1", 256, 512, 512),
    ("down4.maxpool_conv.1", 512, 512, 512),
    ("up1.conv", 1024, 512, 256),
    ("up2.conv", 512, 256, 128),
    ("up3.conv", 256, 128, 64),
    ("up4.conv", 128, 64, 64),
]
# ConvTranspose2d weights are [in, out, 2, 2].
TRANSPOSED_UP = [("up1", 1024, 512), ("up2", 512, 256), ("up3", 256, 128), ("up4", 128, 64)]


def expected_keys(blocks, up_layers, n_classes: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for prefix, in_ch, mid_ch, out_ch in blocks:
        base = f"{prefix}.double_conv"
        shapes[f"{base}.0.weight"] = (mid_ch, in_ch, 3, 3)
        for index, channels in ((1, mid_ch), (4, out_ch)):
            for name in ("weight", "bias", "running_mean", "running_var"):
                shapes[f"{base}.{index}.{name}"] = (channels,)
            shapes[f"{base}.{index}.num_batches_tracked"] = ()
        shapes[f"{base}.3.weight"] = (out_ch, mid_ch, 3, 3)
    for prefix, in_ch, out_ch in up_layers:
        shapes[f"{prefix}.up.weight"] = (in_ch, out_ch, 2, 2)
        shapes[f"{prefix}.up.bias"] = (out_ch,)
    shapes["outc.conv.weight"] = (n_classes, 64, 1, 1)
    shapes["outc.conv.bias"] = (n_classes,)
    return shapes


@pytest.mark.parametrize(
    ("bilinear", "blocks", "up_layers", "n_keys"),
    [(False, TRANSPOSED_BLOCKS, TRANSPOSED_UP, 118), (True, BILINEAR_BLOCKS, [], 110)],
)
def test_state_dict_keys_and_shapes_match_classic_unet(bilinear, blocks, up_layers, n_keys) -> None:
    model = UNet(n_channels=3, n_classes=2, bilinear=bilinear)
    actual = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    expected = expected_keys(blocks, up_layers, n_classes=2)
    assert len(expected) == n_keys
    assert actual == expected


@pytest.mark.parametrize("bilinear", [False, True])
@pytest.mark.parametrize(("height", "width"), [(32, 32), (33, 47), (17, 64), (1, 1), (45, 31)])
def test_any_input_size_gives_logits_of_that_size(bilinear, height, width) -> None:
    model = UNet(3, 4, bilinear=bilinear, base_channels=8).eval()
    with torch.no_grad():
        logits = model(torch.rand(2, 3, height, width))
    assert logits.shape == (2, 4, height, width)


def test_constructor_args_rebuild_the_same_model() -> None:
    model = UNet(1, 3, bilinear=True, base_channels=8)
    assert model.constructor_args() == {"n_channels": 1, "n_classes": 3, "bilinear": True, "base_channels": 8}
    clone = UNet(**model.constructor_args())
    clone.load_state_dict(model.state_dict())


@pytest.mark.parametrize("bilinear", [False, True])
def test_activation_checkpointing_gives_same_gradients_and_buffers(bilinear) -> None:
    torch.manual_seed(0)
    reference = UNet(3, 2, bilinear=bilinear, base_channels=8)
    checkpointed = UNet(3, 2, bilinear=bilinear, base_channels=8)
    checkpointed.load_state_dict(reference.state_dict())
    checkpointed.use_checkpointing()
    images = torch.rand(2, 3, 36, 28)
    target = torch.randint(0, 2, (2, 36, 28))
    for model in (reference, checkpointed):
        torch.nn.functional.cross_entropy(model(images), target).backward()
    for (name, ref_param), (_, ckpt_param) in zip(
        reference.named_parameters(), checkpointed.named_parameters(), strict=True
    ):
        assert ckpt_param.grad is not None, name
        torch.testing.assert_close(ckpt_param.grad, ref_param.grad, rtol=1e-5, atol=1e-6, msg=name)
    # Recomputation must not update BatchNorm running statistics a second time.
    for (name, ref_buffer), (_, ckpt_buffer) in zip(
        reference.named_buffers(), checkpointed.named_buffers(), strict=True
    ):
        assert torch.equal(ckpt_buffer, ref_buffer), name


def test_channels_last_matches_contiguous() -> None:
    torch.manual_seed(0)
    model = UNet(3, 2, base_channels=8).eval()
    images = torch.rand(2, 3, 40, 56)
    with torch.no_grad():
        expected = model(images)
        model_cl = model.to(memory_format=torch.channels_last)
        actual = model_cl(images.to(memory_format=torch.channels_last))
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


def test_invalid_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="n_classes=0"):
        UNet(3, 0)
