"""A code-bearing pickle is named as such ("contains code (pickled objects: ...), refused"), never with torch's advice
to load it unsafely; plain data, our checkpoints and tensor files are not."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from tests.helpers import RunsCodeWhenUnpickled, save_checkpoint, tiny_unet, write_trojan_checkpoint
from utils.checkpoint.files import load_checkpoint_file
from utils.datasets.image_files import load_image
from utils.errors import CheckpointError, DatasetError


def plain_pickle_with_global(path: Path, marker: Path) -> Path:
    path.write_bytes(pickle.dumps(RunsCodeWhenUnpickled(marker), protocol=2))
    return path


def legacy_trojan_checkpoint(path: Path, marker: Path) -> Path:
    torch.save({"hook": RunsCodeWhenUnpickled(marker)}, path, _use_new_zipfile_serialization=False)
    return path


@pytest.mark.parametrize("make", [write_trojan_checkpoint, plain_pickle_with_global, legacy_trojan_checkpoint])
def test_a_pickle_that_imports_code_is_refused_as_code(tmp_path, make):
    marker = tmp_path / "ran"
    path = make(tmp_path / "model.pth", marker)
    imported = f"{RunsCodeWhenUnpickled(marker).__reduce__()[0].__module__}.system"
    with pytest.raises(CheckpointError, match=rf"contains code \(pickled objects: {imported}\), refused") as caught:
        load_checkpoint_file(path)
    assert "weights_only" not in str(caught.value) and "could run code" in str(caught.value)
    assert not marker.exists()


def test_a_plain_data_pickle_is_not_called_code_and_gets_no_unsafe_advice(tmp_path):
    path = tmp_path / "numbers.pkl"
    path.write_bytes(pickle.dumps({"x": [1, 2, 3]}, protocol=4))
    with pytest.raises(CheckpointError, match=r"corrupt or not a PyTorch file \(Unsupported operand \d+\)") as caught:
        load_checkpoint_file(path)
    assert "weights_only" not in str(caught.value) and "contains code" not in str(caught.value)


@pytest.mark.parametrize("legacy", [False, True])
def test_our_checkpoints_and_plain_tensors_import_no_code(tmp_path, legacy):
    path = save_checkpoint(tmp_path / "model.pth", tiny_unet(), [0, 1])
    assert load_checkpoint_file(path)["model_state"].keys() == tiny_unet().state_dict().keys()
    torch.save(torch.zeros(4, 4), tmp_path / "image.pt", _use_new_zipfile_serialization=not legacy)
    assert load_image(tmp_path / "image.pt").size == (4, 4)


def test_a_dataset_tensor_file_carrying_code_is_refused_as_code(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "image.pt"
    torch.save({"pixels": torch.zeros(4, 4), "hook": RunsCodeWhenUnpickled(marker)}, path)
    with pytest.raises(DatasetError, match=r"contains code \(pickled objects: \w+\.system\), refused"):
        load_image(path)
    assert not marker.exists()
