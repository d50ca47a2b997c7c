"""Model export (predict.py --export) and the torch.hub entry point."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import predict
from tests.conftest import REPO_ROOT
from tests.helpers import make_model, one_error_line, save_checkpoint, save_checkpoint_trained_at
from utils.errors import USER_ERROR_EXIT_CODE, CheckpointError
from utils.inference import export
from utils.inference.export import METADATA_PREFIX, ExportError, Preprocessing, export_model


def read_preprocessing(path: Path) -> dict[str, object]:
    """The preprocessing record of an exported ONNX file (``Preprocessing.metadata``), values decoded, read as
    docs/TOOLS.md tells a user to read it (onnx's ``metadata_props``)."""
    import onnx

    props = onnx.load(str(path), load_external_data=False).metadata_props
    record = {
        prop.key.removeprefix(METADATA_PREFIX): prop.value for prop in props if prop.key.startswith(METADATA_PREFIX)
    }
    return {name: value if name in ("input", "output") else json.loads(value) for name, value in record.items()}


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


def test_predict_exports_onnx_as_one_file_that_matches_pytorch_and_carries_the_checkpoints_preprocessing(
    tmp_path, capsys
):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    onnxruntime = pytest.importorskip("onnxruntime")
    # What train.py records beside the weights: the scale, the void values and the class names of its flags.
    checkpoint = save_checkpoint_trained_at(
        tmp_path / "m.pth", make_model(2), 0.25, [0, 255], ignore_values=[128], class_names="bg,car"
    )
    folder = tmp_path / "out"
    path = folder / "model.onnx"
    assert predict.main(["-m", str(checkpoint), "--export", "onnx", str(path), "--export-size", "48x32"]) == 0
    compared = re.search(r"checked with onnxruntime, max \|difference\| (\S+)\)", capsys.readouterr().out)
    assert compared and float(compared[1]) < 1e-4
    assert [child.name for child in folder.iterdir()] == ["model.onnx"]  # no side file, no temporary left
    recorded = read_preprocessing(path)
    assert {key: recorded[key] for key in ("scale", "mask_values", "channels", "ignore_values", "class_names")} == {
        "scale": 0.25,
        "mask_values": [0, 255],
        "channels": 3,
        "ignore_values": [128],
        "class_names": ["bg", "car"],
    }
    assert "/ 255" in recorded["input"] and "mask_values[class]" in recorded["output"]
    import onnx

    graph = onnx.load(str(path)).graph
    shapes = [[dim.dim_param or dim.dim_value for dim in value.type.tensor_type.shape.dim]
              for value in (graph.input[0], graph.output[0])]  # fmt: skip
    assert shapes == [["batch", 3, "height", "width"], ["batch", 2, "height", "width"]]
    # It travels alone: copied elsewhere by itself, it loads and runs.
    moved = shutil.copy(path, tmp_path / "alone.onnx")
    session = onnxruntime.InferenceSession(str(moved), providers=["CPUExecutionProvider"])
    images = torch.rand(1, 3, 32, 32)
    with torch.inference_mode():
        expected = make_model(2)(images)
    torch.testing.assert_close(
        torch.from_numpy(session.run(None, {"image": images.numpy()})[0]), expected, atol=1e-4, rtol=1e-4
    )


@pytest.mark.slow
def test_onnx_above_the_protobuf_limit_keeps_its_weights_beside_it_and_says_so(tmp_path, monkeypatch, caplog):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    onnxruntime = pytest.importorskip("onnxruntime")
    # A tiny model stands in for one above 2 GB: the rule's limit is lowered below its size.
    monkeypatch.setattr(export, "EXTERNAL_DATA_ABOVE_BYTES", 1024)
    path = tmp_path / "out" / "model.onnx"
    with caplog.at_level("WARNING", logger="utils.inference.export"):
        difference = export_model(make_model(2), "onnx", path, (32, 32), Preprocessing(0.5, [0, 1], 3))
    assert difference is not None and difference < 1e-4  # compared in onnxruntime
    assert sorted(child.name for child in path.parent.iterdir()) == ["model.onnx", "model.onnx.data"]
    assert [record.message for record in caplog.records if "2 GB" in record.message] == [
        "The model is above ONNX's 2 GB file limit: its weights are in model.onnx.data beside model.onnx; copy both "
        "files together"
    ]
    assert read_preprocessing(path)["scale"] == 0.5
    # Both files together, elsewhere, load and run.
    moved = tmp_path / "moved"
    shutil.copytree(path.parent, moved)
    session = onnxruntime.InferenceSession(str(moved / "model.onnx"), providers=["CPUExecutionProvider"])
    assert session.run(None, {"image": torch.rand(1, 3, 32, 32).numpy()})[0].shape == (1, 2, 32, 32)


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


def test_hub_models_come_back_in_eval_mode(tmp_path):
    model = torch.hub.load(str(REPO_ROOT), "unet", source="local", base_channels=8)
    assert not model.training
    checkpoint = save_checkpoint(tmp_path / "m.pth", make_model(2), [0, 255])
    assert not torch.hub.load(str(REPO_ROOT), "unet", source="local", checkpoint=str(checkpoint)).training


def test_hub_has_milesials_unet_carvana_entry_point():
    model = torch.hub.load(str(REPO_ROOT), "unet_carvana", source="local")
    assert model.constructor_args() == {"n_channels": 3, "n_classes": 2, "bilinear": False, "base_channels": 64}
    assert not model.training and model.scale == 0.5
    assert torch.hub.load(str(REPO_ROOT), "unet_carvana", source="local", pretrained=False, scale=1.0).scale == 1.0
    with pytest.raises(CheckpointError, match=r"downloads no weights; they come from a local file") as raised:
        torch.hub.load(str(REPO_ROOT), "unet_carvana", source="local", pretrained=True)
    assert len(str(raised.value).splitlines()) == 1 and "checkpoint=" in str(raised.value)
