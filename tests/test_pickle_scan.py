"""A code-bearing pickle is named as such ("contains code (pickled objects), refused"), never with torch's advice to
load it unsafely; plain data and our checkpoints are not."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from tests.helpers import RunsCodeWhenUnpickled, save_checkpoint, tiny_unet, write_trojan_checkpoint
from utils.checkpoint.files import load_checkpoint_file
from utils.checkpoint.pickle_scan import pickled_code
from utils.datasets.image_files import load_image
from utils.errors import CheckpointError, DatasetError


def plain_pickle_with_global(path: Path, marker: Path) -> Path:
    path.write_bytes(pickle.dumps(RunsCodeWhenUnpickled(marker), protocol=2))
    return path


@pytest.mark.parametrize("make", [write_trojan_checkpoint, plain_pickle_with_global])
def test_a_pickle_that_imports_code_is_refused_as_code(tmp_path, make):
    marker = tmp_path / "ran"
    path = make(tmp_path / "model.pth", marker)
    assert pickled_code(path) == [f"{RunsCodeWhenUnpickled(marker).__reduce__()[0].__module__}.system"]
    with pytest.raises(CheckpointError, match=r"contains code \(pickled objects: \w+\.system\), refused") as caught:
        load_checkpoint_file(path)
    assert "weights_only" not in str(caught.value) and "could run code" in str(caught.value)
    assert not marker.exists()


def test_a_plain_data_pickle_is_not_called_code_and_gets_no_unsafe_advice(tmp_path):
    path = tmp_path / "numbers.pkl"
    path.write_bytes(pickle.dumps({"x": [1, 2, 3]}, protocol=4))
    assert pickled_code(path) == []
    with pytest.raises(CheckpointError, match="corrupt or not a PyTorch file") as caught:
        load_checkpoint_file(path)
    assert "weights_only" not in str(caught.value) and "contains code" not in str(caught.value)


@pytest.mark.parametrize("legacy", [False, True])
def test_our_checkpoints_and_plain_tensors_import_no_code(tmp_path, legacy):
    path = save_checkpoint(tmp_path / "model.pth", tiny_unet(), [0, 1])
    assert pickled_code(path) == []
    torch.save({"w": torch.zeros(3)}, tmp_path / "w.pt", _use_new_zipfile_serialization=not legacy)
    assert pickled_code(tmp_path / "w.pt") == []


def test_a_dataset_tensor_file_carrying_code_is_refused_as_code(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "image.pt"
    torch.save({"pixels": torch.zeros(4, 4), "hook": RunsCodeWhenUnpickled(marker)}, path)
    with pytest.raises(DatasetError, match=r"contains code \(pickled objects: \w+\.system\), refused"):
        load_image(path)
    assert not marker.exists()
