"""--encoder, --encoder-weights, --freeze-encoder-epochs and --deep-supervision in real runs, and their checkpoints
in predict.py, export and torch.hub, with every socket connection refused (nothing may be downloaded)."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision

import hubconf
import predict
from tests.conftest import finish, load_checkpoint, torchrun_prefix
from tests.helpers import one_error_line, read_classes, reference_classes
from unet import UNetArgs
from unet.resnet_unet import ResNetUNet
from utils.checkpoint.model import load_model


@pytest.fixture
def no_network(monkeypatch):
    """Every attempt to open a network connection fails loudly (a download would be one)."""

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"network access attempted: connect{args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


@pytest.fixture
def resnet18_file(tmp_path: Path) -> Path:
    """A torchvision resnet18 state dict as torchvision caches it (fc included), random weights."""
    torch.manual_seed(7)
    path = tmp_path / "resnet18-f37072fd.pth"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), path)
    return path


def encoder_parameters(model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The encoder's learnt parameters (BatchNorm's running statistics move in training mode even when frozen)."""
    model = ResNetUNet(UNetArgs(3, 2, encoder="resnet18", base_channels=8))
    names = {name for name, _ in model.encoder.named_parameters()}
    return {name: model_state[f"encoder.{name}"] for name in names}


def test_resnet_run_with_local_encoder_weights_frozen_then_trained(runner, resnet18_file, no_network, tmp_path):
    code = runner.main(
        "rn", "-e", "3", "--encoder", "resnet18", "--encoder-weights", str(resnet18_file), "--freeze-encoder-epochs",
        "2", "--save-every", "1",
    )  # fmt: skip
    assert code == 0
    stored = torch.load(resnet18_file, weights_only=True)
    epochs = [load_checkpoint(runner.run_dir("rn") / f"checkpoint_epoch{n}.pth") for n in (1, 2, 3)]
    assert epochs[0]["model_args"]["encoder"] == "resnet18"
    # Epochs 1 and 2: the encoder is the file's, untouched, while the decoder trains; epoch 3: the encoder trains.
    for state in epochs[:2]:
        for name, value in encoder_parameters(state["model_state"]).items():
            assert torch.equal(value, stored[name]), name
    assert not torch.equal(epochs[0]["model_state"]["head.weight"], epochs[1]["model_state"]["head.weight"])
    last_encoder = encoder_parameters(epochs[2]["model_state"])
    assert any(not torch.equal(value, stored[name]) for name, value in last_encoder.items())

    # predict.py rebuilds the ResNet model (with its input normalisation) from the file alone.
    checkpoint = runner.run_dir("rn") / "checkpoint_epoch3.pth"
    hub_model = hubconf.unet(checkpoint=str(checkpoint)).eval()
    assert isinstance(hub_model, ResNetUNet)
    out = tmp_path / "pred"
    argv = ["-m", str(checkpoint), "-i", str(runner.data.imgs), "--output-dir", str(out), "-s", "1", "--no-progress"]
    assert predict.main([*argv, "-j", "0"]) == 0
    written = sorted(out.glob("*_OUT.png"))
    assert len(written) == runner.data.n_images
    expected = reference_classes(hub_model, runner.data.imgs / f"{written[0].stem.removesuffix('_OUT')}.jpg", 1.0)
    assert np.array_equal(read_classes(written[0], hub_model.mask_values), expected)

    exported = tmp_path / "model.pt"
    assert (
        predict.main(["-m", str(checkpoint), "--export", "torchscript", str(exported), "--export-size", "48x48"]) == 0
    )
    scripted = torch.jit.load(str(exported))
    images = torch.rand(1, 3, 40, 72)  # not a multiple of 32: the exported graph pads and crops too
    with torch.no_grad():
        assert torch.allclose(scripted(images), hub_model(images), atol=1e-4)


def test_deep_supervision_run_and_its_checkpoint_in_predict(runner, no_network, tmp_path):
    assert runner.main("ds", "-e", "1", "--deep-supervision") == 0
    checkpoint = runner.run_dir("ds") / "last.pth"
    state = load_checkpoint(checkpoint)
    assert state["model_args"]["deep_supervision"] is True
    assert {"aux_heads.convs.0.weight", "aux_heads.convs.1.weight"} <= set(state["model_state"])
    # Inference builds the heads (the weights load strictly) and returns the full-resolution logits alone.
    model, spec = load_model(checkpoint)
    assert spec.deep_supervision
    with torch.no_grad():
        assert model.eval()(torch.rand(1, 3, 32, 48)).shape == (1, 2, 32, 48)
    out = tmp_path / "pred"
    argv = ["-m", str(checkpoint), "-i", str(runner.data.imgs), "--output-dir", str(out), "-s", "1", "--no-progress"]
    assert predict.main([*argv, "-j", "0"]) == 0
    assert len(list(out.glob("*_OUT.png"))) == runner.data.n_images


def test_load_across_deep_supervision_names_the_flag(runner, capsys):
    assert runner.main("plain", "-e", "1", "--max-steps", "1") == 0
    capsys.readouterr()
    assert runner.main("ds", "-e", "1", "--deep-supervision", "--load", str(runner.run_dir("plain") / "last.pth")) == 2
    assert "drop --deep-supervision" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--encoder-weights", "{file}"], "need a ResNet encoder; add --encoder resnet34"),
        (["--encoder", "resnet34", "--encoder-weights", "{file}"], "does not fit --encoder resnet34"),
        (["--encoder", "resnet18", "--encoder-weights", "{missing}"], "no such file"),
        (["--encoder", "resnet18", "--bilinear"], "--bilinear applies to --encoder unet only"),
    ],
)
def test_encoder_flag_errors_are_one_line(runner, resnet18_file, capsys, extra, message):
    extra = [arg.format(file=resnet18_file, missing=resnet18_file.with_name("absent.pth")) for arg in extra]
    assert runner.main("bad", "-e", "1", *extra) == 2
    assert message in one_error_line(capsys.readouterr().err)


def _damage(weights: dict[str, torch.Tensor], kind: str) -> None:
    if kind == "nan":
        weights["layer1.0.conv1.weight"].view(-1)[3] = float("nan")
    elif kind == "inf variance":
        weights["bn1.running_var"][0] = float("inf")
    elif kind == "negative variance":
        weights["bn1.running_var"][0] = -1.0
    elif kind == "int64":
        weights["conv1.weight"] = weights["conv1.weight"].long()
    elif kind == "complex":
        weights["conv1.weight"] = weights["conv1.weight"].to(torch.complex64)
    else:
        weights["bn1.weight"] = weights["bn1.weight"].to_sparse()


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("nan", r"holds NaN or inf weights \(layer1\.0\.conv1\.weight\): the file is damaged"),
        ("inf variance", r"holds NaN or inf weights \(bn1\.running_var\): the file is damaged"),
        (
            "negative variance",
            r"holds a negative BatchNorm variance in bn1\.running_var \(min -1\).*the file is damaged",
        ),
        ("int64", r"holds conv1\.weight as torch\.int64, not floating point"),
        ("complex", r"holds conv1\.weight as torch\.complex64, not floating point"),
        ("sparse", r"holds bn1\.weight as a torch\.sparse_coo tensor, not a dense one"),
    ],
)
def test_damaged_encoder_weights_are_refused_as_checkpoints_are(runner, resnet18_file, capsys, kind, message):
    """The checkpoint reader's checks, for --encoder-weights: refused before any step, naming the file and the fix."""
    weights = torch.load(resnet18_file, weights_only=True)
    _damage(weights, kind)
    torch.save(weights, resnet18_file)
    assert runner.main("damaged", "-e", "1", "--encoder", "resnet18", "--encoder-weights", str(resnet18_file)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert re.search(rf"--encoder-weights {re.escape(str(resnet18_file))}.*{message}", line), line
    assert "torchvision.models.resnet34(weights='IMAGENET1K_V1')" in line  # the fix: make the file again
    assert not (runner.run_dir("damaged") / "last.pth").exists()


@pytest.mark.slow
def test_ddp_two_processes_with_resnet_frozen_encoder_and_deep_supervision(runner, resnet18_file):
    """Frozen encoder parameters and auxiliary heads must not trip DDP's unused-parameter check."""
    process = runner.popen(
        torchrun_prefix(2), "ddp", "--ddp_mode", "-e", "2", "--encoder", "resnet18", "--encoder-weights",
        str(resnet18_file), "--freeze-encoder-epochs", "1", "--deep-supervision",
    )  # fmt: skip
    out, err = finish(process)
    assert process.returncode == 0, err[-3000:]
    state = load_checkpoint(runner.run_dir("ddp") / "last.pth")
    assert state["world_size"] == 2 and state["epoch"] == 2
    stored = torch.load(resnet18_file, weights_only=True)
    frozen = encoder_parameters(load_checkpoint(runner.run_dir("ddp") / "checkpoint_epoch1.pth")["model_state"])
    assert all(torch.equal(value, stored[name]) for name, value in frozen.items())
