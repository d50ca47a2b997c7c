"""The checkpoint format: atomic writes, safe loads, foreign formats, clear errors."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from unet import UNet
from utils.checkpoint import (
    FORMAT_VERSION,
    KEY_FORMAT_VERSION,
    KEY_MASK_VALUES,
    KEY_MODEL,
    KEY_MODEL_ARGS,
    build_model_from_checkpoint,
    is_complete_checkpoint,
    load_checkpoint_file,
    read_model_weights,
    save_checkpoint_atomic,
)
from utils.errors import CheckpointError


def tiny_model(seed: int = 0, **kwargs) -> UNet:
    torch.manual_seed(seed)
    return UNet(3, kwargs.pop("n_classes", 2), base_channels=8, **kwargs)


def assert_same_weights(first: torch.nn.Module, second: torch.nn.Module) -> None:
    first_state, second_state = first.state_dict(), second.state_dict()
    assert first_state.keys() == second_state.keys()
    for key in first_state:
        assert torch.equal(first_state[key], second_state[key]), key


def our_payload(model: UNet, mask_values=(0, 1)) -> dict:
    return {
        KEY_FORMAT_VERSION: FORMAT_VERSION,
        KEY_MODEL: model.state_dict(),
        KEY_MODEL_ARGS: model.constructor_args(),
        KEY_MASK_VALUES: list(mask_values),
    }


def test_round_trip_is_bit_exact_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    model = tiny_model()
    path = tmp_path / "run" / "last.pth"
    save_checkpoint_atomic(our_payload(model, [0, 255]), path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.pth"]
    rebuilt, mask_values = build_model_from_checkpoint(path)
    assert mask_values == [0, 255]
    assert rebuilt.constructor_args() == model.constructor_args()
    assert_same_weights(rebuilt, model)
    assert is_complete_checkpoint(path)


def test_overwrite_replaces_the_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "last.pth"
    save_checkpoint_atomic(our_payload(tiny_model(0)), path)
    newer = tiny_model(1)
    save_checkpoint_atomic(our_payload(newer), path)
    rebuilt, _ = build_model_from_checkpoint(path)
    assert_same_weights(rebuilt, newer)


def test_milesial_bare_state_dict_with_mask_values_loads_without_flags(tmp_path: Path) -> None:
    model = tiny_model(n_classes=3, bilinear=True)
    state = model.state_dict()
    state["mask_values"] = [0, 127, 255]
    torch.save(state, tmp_path / "milesial.pth")
    rebuilt, mask_values = build_model_from_checkpoint(tmp_path / "milesial.pth")
    assert mask_values == [0, 127, 255]
    # Arguments are recovered from the weights' shapes.
    assert rebuilt.constructor_args() == {"n_channels": 3, "n_classes": 3, "bilinear": True, "base_channels": 8}
    assert_same_weights(rebuilt, model)


def test_ddp_prefixed_state_dict_loads(tmp_path: Path) -> None:
    model = tiny_model()
    prefixed = {f"module.{key}": value for key, value in model.state_dict().items()}
    torch.save({"model_state_dict": prefixed, "mask_values": [0, 1]}, tmp_path / "ddp.pth")
    loaded = read_model_weights(tmp_path / "ddp.pth")
    assert all(not key.startswith("module.") for key in loaded.state_dict)
    rebuilt, _ = build_model_from_checkpoint(tmp_path / "ddp.pth")
    assert_same_weights(rebuilt, model)


def test_flag_that_contradicts_the_checkpoint_names_the_flag(tmp_path: Path) -> None:
    save_checkpoint_atomic(our_payload(tiny_model()), tmp_path / "a.pth")
    with pytest.raises(CheckpointError, match=r"n_classes=2 but --classes asks for 5"):
        build_model_from_checkpoint(tmp_path / "a.pth", n_classes=5)


def test_weights_that_do_not_fit_are_explained(tmp_path: Path) -> None:
    model = tiny_model()
    payload = our_payload(model)
    payload[KEY_MODEL_ARGS] = {**model.constructor_args(), "n_classes": 4}
    save_checkpoint_atomic(payload, tmp_path / "bad.pth")
    with pytest.raises(CheckpointError, match=r"does not fit the model .*outc.conv.weight.*--classes"):
        build_model_from_checkpoint(tmp_path / "bad.pth")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is empty"),
        (b"this is not a checkpoint at all", "corrupt"),
        (bytes(range(256)) * 8, "corrupt"),
    ],
)
def test_unusable_files_give_one_clear_error(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "broken.pth"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint_file(path)
    assert not is_complete_checkpoint(path)


def test_missing_file_and_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint_file(tmp_path / "nope.pth")
    with pytest.raises(CheckpointError, match="is a folder"):
        load_checkpoint_file(tmp_path)


def test_truncated_checkpoint_is_reported_as_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "last.pth"
    save_checkpoint_atomic(our_payload(tiny_model()), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint_file(path)


def test_non_checkpoint_objects_are_rejected(tmp_path: Path) -> None:
    torch.save(torch.zeros(3), tmp_path / "tensor.pth")
    with pytest.raises(CheckpointError, match="not a checkpoint dictionary"):
        load_checkpoint_file(tmp_path / "tensor.pth")
    torch.save({"epoch": 3, "note": "hello"}, tmp_path / "dict.pth")
    with pytest.raises(CheckpointError, match="not a model checkpoint"):
        read_model_weights(tmp_path / "dict.pth")


class _CreatesFileWhenUnpickled:
    """A hostile payload: unpickling it would call os.system and create a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def test_malicious_pickle_is_refused_without_running_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pth"
    torch.save({"model_state": {}, "payload": _CreatesFileWhenUnpickled(marker)}, path)
    with pytest.raises(CheckpointError, match="could run code"):
        load_checkpoint_file(path)
    assert not marker.exists()
    # Prove the file really is dangerous: an unsafe load (weights_only=False) runs the command.
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_plain_pickle_file_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned2"
    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps(_CreatesFileWhenUnpickled(marker)))
    with pytest.raises(CheckpointError):
        load_checkpoint_file(path)
    assert not marker.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores folder permissions")
def test_read_only_folder_gives_clear_error(tmp_path: Path) -> None:  # pragma: no cover - root in CI
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    with pytest.raises(CheckpointError, match="--checkpoint-dir"):
        save_checkpoint_atomic(our_payload(tiny_model()), folder / "last.pth")


def test_unwritable_target_keeps_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "last.pth"
    first = tiny_model(0)
    save_checkpoint_atomic(our_payload(first), path)
    # A folder squatting on the final name makes os.replace fail, as a full disk or a permission error would.
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "last.pth").mkdir()
    with pytest.raises(CheckpointError, match="could not save checkpoint"):
        save_checkpoint_atomic(our_payload(tiny_model(1)), blocked / "last.pth")
    assert [p.name for p in blocked.iterdir()] == ["last.pth"]
    rebuilt, _ = build_model_from_checkpoint(path)
    assert_same_weights(rebuilt, first)
