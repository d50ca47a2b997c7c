"""Model export (predict.py --export) and the torch.hub entry point."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

import predict
from tests.conftest import REPO_ROOT
from tests.helpers import make_model, one_error_line, save_checkpoint
from utils.errors import USER_ERROR_EXIT_CODE, CheckpointError
from utils.inference.export import ExportError, export_model


def _load_torchscript(path: Path) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated but still the TorchScript loader
        return torch.jit.load(str(path))


def test_predict_cli_exports_torchscript_from_a_checkpoint(tmp_path, capsys):
    model = make_model(1)
    checkpoint = save_checkpoint(tmp_path / "m.pth", model, [0, 255], style="milesial")
    path = tmp_path / "out" / "model.ts"
    assert predict.main(["-m", str(checkpoint), "--export", "torchscript", str(path), "--export-size", "64x32"]) == 0
    assert "checked with torch.jit.load" in capsys.readouterr().out
    # Sizes and batch other than the sample's work too (heights and widths that are multiples of 16).
    images = torch.rand(3, 3, 48, 96)
    with torch.inference_mode():
        torch.testing.assert_close(_load_torchscript(path)(images), model(images), rtol=1e-4, atol=1e-4)


def test_an_export_that_does_not_reproduce_the_model_is_refused(tmp_path, monkeypatch):
    other = make_model(2, seed=1)
    real_load = torch.jit.load

    def load_wrong_model(*args, **kwargs):
        real_load(*args, **kwargs)
        return other

    monkeypatch.setattr(torch.jit, "load", load_wrong_model)
    with pytest.raises(ExportError, match="differs from PyTorch"):
        export_model(make_model(2), "torchscript", tmp_path / "model.pt", (32, 32))
    assert not (tmp_path / "model.pt").exists()


def test_export_flags_are_checked(tmp_path, capsys):
    checkpoint = save_checkpoint(tmp_path / "m.pth", make_model(2), [0, 1])
    assert predict.main(["-m", str(checkpoint), "--export", "tflite", "x"]) == USER_ERROR_EXIT_CODE
    assert "--export tflite: choose one of onnx, torchscript" in one_error_line(capsys.readouterr().err)
    code = predict.main(["-m", str(checkpoint), "--export", "onnx", "x", "--export-size", "50x50"])
    assert code == USER_ERROR_EXIT_CODE
    assert "--export-size 50x50: use multiples of 16" in one_error_line(capsys.readouterr().err)


def test_onnx_without_its_packages_says_how_to_install_them(tmp_path, monkeypatch, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("onnx", "onnxscript") else real_find_spec(name)
    )
    checkpoint = save_checkpoint(tmp_path / "m.pth", make_model(2), [0, 1])
    code = predict.main(["-m", str(checkpoint), "--export", "onnx", str(tmp_path / "m.onnx"), "--export-size", "32x32"])
    assert code == USER_ERROR_EXIT_CODE
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "pip install onnx onnxscript" in one_error_line(err)
    assert not (tmp_path / "m.onnx").exists()


def test_onnx_export_matches_pytorch(tmp_path):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    path = tmp_path / "model.onnx"
    report = export_model(make_model(2), "onnx", path, (32, 48))
    assert path.stat().st_size > 0
    if importlib.util.find_spec("onnxruntime") is not None:
        assert report.checked_with == "onnxruntime"
        assert report.max_abs_difference is not None and report.max_abs_difference < 1e-4


def test_hub_builds_a_model_from_local_code_only(tmp_path):
    model = torch.hub.load(str(REPO_ROOT), "unet", source="local", n_channels=1, n_classes=3, base_channels=8)
    assert model.constructor_args() == {"n_channels": 1, "n_classes": 3, "bilinear": False, "base_channels": 8}


def test_hub_loads_weights_and_architecture_from_a_local_checkpoint(tmp_path):
    trained = make_model(2, bilinear=True, seed=3)
    for style in ("ours", "ddp"):
        checkpoint = save_checkpoint(tmp_path / f"{style}.pth", trained, [0, 255], style=style)
        model = torch.hub.load(str(REPO_ROOT), "unet", source="local", checkpoint=str(checkpoint))
        assert model.constructor_args() == trained.constructor_args()
        assert model.mask_values == [0, 255]
        for key, tensor in trained.state_dict().items():
            assert torch.equal(model.state_dict()[key], tensor), key


def test_hub_never_downloads(tmp_path):
    with pytest.raises(CheckpointError, match="no pretrained weights"):
        torch.hub.load(str(REPO_ROOT), "unet", source="local", pretrained=True)
    with pytest.raises(CheckpointError, match="only local files"):
        torch.hub.load(str(REPO_ROOT), "unet", source="local", checkpoint="https://example.com/unet.pth")
