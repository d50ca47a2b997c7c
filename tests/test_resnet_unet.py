"""ResNet-encoder UNet, deep-supervision heads and loss, and --encoder-weights files: unit tests on real tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision

from unet import UNet, UNetArgs, build_model
from unet.resnet_unet import IMAGENET_MEAN, IMAGENET_STD, ResNetUNet
from utils.checkpoint.model import load_model
from utils.errors import ConfigError
from utils.training.model import load_encoder_weights
from utils.training.objective import segmentation_loss, supervised_loss

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"
PLAIN_ARGS = {"n_channels": 3, "n_classes": 2, "bilinear": False, "base_channels": 8}


def torchvision_file(path: Path, name: str = "resnet18", seed: int = 0) -> Path:
    """A state dict exactly as torchvision caches one (fc included), with weights drawn from ``seed``."""
    torch.manual_seed(seed)
    torch.save(getattr(torchvision.models, name)(weights=None).state_dict(), path)
    return path


def test_args_without_encoder_build_milesials_unet_with_its_keys():
    model = build_model(PLAIN_ARGS)
    assert type(model) is UNet
    assert model.constructor_args() == PLAIN_ARGS  # optional arguments at their defaults are not written
    torch.manual_seed(0)
    assert list(model.state_dict()) == list(UNet(3, 2, base_channels=8).state_dict())


def test_milesial_checkpoint_still_loads_as_unet():
    model, spec = load_model(FIXTURES / "milesial.pth")
    assert type(model) is UNet and spec.encoder == "unet" and not spec.deep_supervision


@pytest.mark.parametrize("encoder", ["resnet18", "resnet50"])
@pytest.mark.parametrize("size", [(37, 45), (20, 70), (64, 32)])
def test_resnet_unet_any_size_gives_logits_of_the_input_size(encoder, size):
    model = ResNetUNet(UNetArgs(1, 3, encoder=encoder, base_channels=8)).eval()
    with torch.no_grad():
        assert model(torch.rand(2, 1, *size)).shape == (2, 3, *size)


def test_resnet_unet_normalises_its_own_input_with_imagenet_statistics():
    torch.manual_seed(0)
    model = ResNetUNet(UNetArgs(3, 2, encoder="resnet18", base_channels=8)).eval()
    assert "input_mean" not in model.state_dict()  # follows from the architecture; not a stored tensor
    images = torch.rand(1, 3, 32, 32)
    with torch.no_grad():
        expected = model(images)
        model.input_mean.zero_()
        model.input_std.fill_(1.0)
        mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
        assert torch.allclose(model((images - mean) / std), expected, atol=1e-6)
        assert not torch.allclose(model(images), expected, atol=1e-3)  # control: the normalisation matters


# The ResNet pads to a multiple of 32 and crops its auxiliary logits to ceil(size / factor); the UNet pools (floor).
@pytest.mark.parametrize(("encoder", "aux_sizes"), [("unet", [(18, 22), (9, 11)]), ("resnet18", [(19, 23), (10, 12)])])
def test_deep_supervision_heads_only_in_training_and_main_output_unchanged(encoder, aux_sizes):
    args = {**PLAIN_ARGS, "encoder": encoder}
    torch.manual_seed(0)
    supervised = build_model({**args, "deep_supervision": True})
    images = torch.rand(2, 3, 37, 45)
    supervised.train()
    outputs = supervised(images)
    assert [tuple(o.shape[-2:]) for o in outputs] == [(37, 45), *aux_sizes]
    # Copied after the training pass, which moved BatchNorm's running statistics.
    state = {key: value for key, value in supervised.state_dict().items() if not key.startswith("aux_heads.")}
    assert len(state) < len(supervised.state_dict())
    plain = build_model(args)
    plain.load_state_dict(state)  # strict: the heads are the only extra keys
    supervised.eval(), plain.eval()
    with torch.no_grad():
        assert torch.equal(supervised(images), plain(images))


def test_supervised_loss_is_the_weighted_sum_over_nearest_downsampled_masks():
    torch.manual_seed(0)
    masks = torch.randint(0, 3, (2, 16, 24))
    masks[0, :4, :4] = -100  # void pixels survive nearest downsampling
    outputs = [torch.randn(2, 3, 16, 24), torch.randn(2, 3, 8, 12), torch.randn(2, 3, 4, 6)]
    expected = (
        4 / 7 * segmentation_loss(outputs[0], masks, 3)
        + 2 / 7 * segmentation_loss(outputs[1], masks[:, ::2, ::2], 3)
        + 1 / 7 * segmentation_loss(outputs[2], masks[:, ::4, ::4], 3)
    )
    assert torch.allclose(supervised_loss(outputs, masks, 3), expected)
    assert torch.equal(supervised_loss(outputs[0], masks, 3), segmentation_loss(outputs[0], masks, 3))
    # One level weighs 1: the plain loss.
    assert torch.equal(supervised_loss(outputs[:1], masks, 3), segmentation_loss(outputs[0], masks, 3))


def test_encoder_weights_equal_the_files_after_loading(tmp_path):
    path = torchvision_file(tmp_path / "resnet18-f37072fd.pth", seed=3)
    model = ResNetUNet(UNetArgs(3, 2, encoder="resnet18", base_channels=8))
    load_encoder_weights(model.encoder, path, "resnet18")
    stored = torch.load(path, weights_only=True)
    loaded = model.encoder.state_dict()
    assert set(loaded) == {key for key in stored if not key.startswith("fc.")}
    for key, value in loaded.items():
        assert torch.equal(value, stored[key]), key


def test_encoder_weights_of_another_resnet_are_one_error_naming_the_file(tmp_path):
    path = torchvision_file(tmp_path / "resnet50.pth", "resnet50")
    model = ResNetUNet(UNetArgs(3, 2, encoder="resnet18", base_channels=8))
    with pytest.raises(ConfigError, match=r"--encoder-weights .*resnet50\.pth does not fit --encoder resnet18"):
        load_encoder_weights(model.encoder, path, "resnet18")


def test_encoder_weights_for_rgb_refused_for_grey_images(tmp_path):
    path = torchvision_file(tmp_path / "r18.pth")
    model = ResNetUNet(UNetArgs(1, 2, encoder="resnet18", base_channels=8))
    with pytest.raises(ConfigError, match=r"conv1\.weight .*3-channel images"):
        load_encoder_weights(model.encoder, path, "resnet18")


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "no such file"), (b"not a torch file", "not a usable torch state dict .*corrupt"), ([1, 2], "state dict")],
)
def test_unusable_encoder_weights_files(tmp_path, content, message):
    path = tmp_path / "weights.pth"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        torch.save(content, path)
    model = ResNetUNet(UNetArgs(3, 2, encoder="resnet18", base_channels=8))
    with pytest.raises(ConfigError, match=f"--encoder-weights {path}.*{message}"):
        load_encoder_weights(model.encoder, path, "resnet18")


def test_downsampled_masks_take_the_nearest_pixel():
    masks = torch.tensor([[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, -100, 11], [12, 13, 14, 15]]])
    generator = torch.Generator().manual_seed(0)
    outputs = [torch.randn(1, 16, 4, 4, generator=generator), torch.randn(1, 16, 2, 2, generator=generator)]
    nearest = torch.tensor([[[0, 2], [8, -100]]])
    expected = 2 / 3 * segmentation_loss(outputs[0], masks, 16) + 1 / 3 * segmentation_loss(outputs[1], nearest, 16)
    assert torch.allclose(supervised_loss(outputs, masks, 16), expected)
