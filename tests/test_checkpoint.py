"""The checkpoint format: atomic writes, safe loads, foreign formats, clear errors."""

from __future__ import annotations

import os
import pickle
import resource
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import TrainRunner
from tests.helpers import (
    RunsCodeWhenUnpickled,
    checkpoint_payload,
    save_checkpoint,
    tiny_unet,
    unwritable_folder,
)
from unet import UNet
from utils.checkpoint.files import (
    copy_checkpoint_atomic,
    load_checkpoint_file,
    load_resume_checkpoint,
    read_model_weights,
    save_checkpoint_atomic,
)
from utils.checkpoint.format import (
    FORMAT_VERSION,
    KEY_ARGS,
    KEY_FORMAT_VERSION,
    KEY_INFERENCE,
    KEY_MODEL_ARGS,
    KEY_TENSOR_DIGESTS,
    InferenceRecord,
    TrainingState,
    TrainPosition,
)
from utils.checkpoint.model import load_model
from utils.errors import CheckpointError


def assert_same_weights(first: torch.nn.Module, second: torch.nn.Module) -> None:
    first_state, second_state = first.state_dict(), second.state_dict()
    assert first_state.keys() == second_state.keys()
    for key in first_state:
        assert torch.equal(first_state[key], second_state[key]), key


def rebuild(path: Path) -> tuple[UNet, list | None]:
    model, spec = load_model(path)
    return model, spec.mask_values


def test_round_trip_is_bit_exact_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    model = tiny_unet()
    path = tmp_path / "run" / "last.pth"
    save_checkpoint_atomic(checkpoint_payload(model, [0, 255]), path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.pth"]
    rebuilt, mask_values = rebuild(path)
    assert mask_values == [0, 255]
    assert rebuilt.constructor_args() == model.constructor_args()
    assert_same_weights(rebuilt, model)
    assert load_checkpoint_file(path)[KEY_FORMAT_VERSION] == FORMAT_VERSION


def test_overwrite_replaces_the_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "last.pth"
    save_checkpoint_atomic(checkpoint_payload(tiny_unet(0)), path)
    newer = tiny_unet(1)
    save_checkpoint_atomic(checkpoint_payload(newer), path)
    rebuilt, _ = rebuild(path)
    assert_same_weights(rebuilt, newer)


def test_milesial_bare_state_dict_with_mask_values_loads_without_flags(tmp_path: Path) -> None:
    model = tiny_unet(n_classes=3, bilinear=True)
    save_checkpoint(tmp_path / "milesial.pth", model, [0, 127, 255], style="milesial")
    rebuilt, mask_values = rebuild(tmp_path / "milesial.pth")
    assert mask_values == [0, 127, 255]
    # Arguments are recovered from the weights' shapes.
    assert rebuilt.constructor_args() == {"n_channels": 3, "n_classes": 3, "bilinear": True, "base_channels": 8}
    assert_same_weights(rebuilt, model)


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "_orig_mod.module."])
def test_ddp_prefixed_state_dict_loads(tmp_path: Path, prefix: str) -> None:
    """DDP's prefix, torch.compile's, and both (a compiled DDP model's keys)."""
    model = tiny_unet()
    prefixed = {f"{prefix}{key}": value for key, value in model.state_dict().items()}
    torch.save({"model_state_dict": prefixed, "mask_values": [0, 1]}, tmp_path / "ddp.pth")
    loaded = read_model_weights(tmp_path / "ddp.pth")
    assert loaded.state_dict.keys() == model.state_dict().keys()
    rebuilt, _ = rebuild(tmp_path / "ddp.pth")
    assert_same_weights(rebuilt, model)


def test_flag_that_contradicts_the_checkpoint_names_the_flag(tmp_path: Path) -> None:
    save_checkpoint_atomic(checkpoint_payload(tiny_unet()), tmp_path / "a.pth")
    with pytest.raises(CheckpointError, match=r"n_classes=2 but --classes asks for 5"):
        load_model(tmp_path / "a.pth", expected={"n_classes": 5})


def test_weights_that_do_not_fit_are_explained(tmp_path: Path) -> None:
    model = tiny_unet()
    payload = checkpoint_payload(model)
    payload[KEY_MODEL_ARGS] = {**model.constructor_args(), "n_classes": 4}
    save_checkpoint_atomic(payload, tmp_path / "bad.pth")
    # Refused before a model is built (utils/checkpoint/model.py), naming the tensor whose shape contradicts the args.
    with pytest.raises(CheckpointError, match=r"contradicts itself: .*outc.conv.weight has shape \(2, 8, 1, 1\)"):
        rebuild(tmp_path / "bad.pth")


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
    with pytest.raises(CheckpointError, match=message):
        read_model_weights(path)


def test_missing_file_and_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint_file(tmp_path / "nope.pth")
    with pytest.raises(CheckpointError, match="is a folder"):
        load_checkpoint_file(tmp_path)


def test_truncated_checkpoint_is_reported_as_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "last.pth"
    save_checkpoint_atomic(checkpoint_payload(tiny_unet()), path)
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


def test_malicious_pickle_is_refused_without_running_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pth"
    torch.save({"model_state": {}, "payload": RunsCodeWhenUnpickled(marker)}, path)
    with pytest.raises(CheckpointError, match="could run code"):
        load_checkpoint_file(path)
    assert not marker.exists()
    # Prove the file really is dangerous: an unsafe load (weights_only=False) runs the command.
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_plain_pickle_file_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned2"
    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps(RunsCodeWhenUnpickled(marker)))
    with pytest.raises(CheckpointError):
        load_checkpoint_file(path)
    assert not marker.exists()


def test_read_only_folder_gives_clear_error(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    with unwritable_folder(folder) as refusal:
        with pytest.raises(CheckpointError, match=f"could not write .*{refusal}.*--checkpoint-dir"):
            save_checkpoint_atomic(checkpoint_payload(tiny_unet()), folder / "last.pth")
    assert list(folder.iterdir()) == []


def _fails_in_the_write(path: Path, payload: dict) -> None:
    """Save ``payload`` over ``path`` with a file size limit of half the current file: the write fails midway (EFBIG,
    as a full disk fails with ENOSPC), after the temporary file beside ``path`` has been created and partly written."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size // 2, hard))
    try:
        save_checkpoint_atomic(payload, path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def _fails_to_start_the_write(path: Path, payload: dict) -> None:
    """Save ``payload`` over ``path`` while its folder accepts no new file: no temporary file can be created."""
    with unwritable_folder(path.parent):
        save_checkpoint_atomic(payload, path)


@pytest.mark.parametrize(
    ("failing_save", "message"),
    [(_fails_in_the_write, "could not write .*File too large"), (_fails_to_start_the_write, "could not write")],
)
def test_a_failed_save_over_a_file_keeps_that_file(tmp_path: Path, failing_save, message: str) -> None:
    path = tmp_path / "last.pth"
    save_checkpoint_atomic(checkpoint_payload(tiny_unet(0)), path)
    previous = path.read_bytes()
    newer = checkpoint_payload(tiny_unet(1))
    with pytest.raises(CheckpointError, match=message):
        failing_save(path, newer)
    assert path.read_bytes() == previous
    assert [p.name for p in tmp_path.iterdir()] == ["last.pth"], "the temporary file must be removed"
    # The same save without the fault does replace the file: the failure above was what kept it.
    save_checkpoint_atomic(newer, path)
    assert path.read_bytes() != previous


def _trained_payload() -> dict:
    model = tiny_unet(0)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.rand(1, 3, 16, 16)).sum().backward()
    optimizer.step()
    return {**checkpoint_payload(model), "optimizer": optimizer.state_dict()}


def test_a_copy_is_a_separate_atomic_file_with_the_same_bytes_and_mode(tmp_path: Path) -> None:
    save_checkpoint_atomic(_trained_payload(), tmp_path / "last.pth")
    copy_checkpoint_atomic(tmp_path / "last.pth", tmp_path / "best.pth")
    last, best = tmp_path / "last.pth", tmp_path / "best.pth"
    assert best.read_bytes() == last.read_bytes()
    assert best.stat().st_ino != last.stat().st_ino
    umask = os.umask(0)
    os.umask(umask)
    assert best.stat().st_mode & 0o777 == last.stat().st_mode & 0o777 == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pth", "last.pth"]


def test_every_tensor_is_digested_and_a_changed_one_is_named(tmp_path: Path) -> None:
    path = tmp_path / "last.pth"
    save_checkpoint_atomic(_trained_payload(), path)
    raw = torch.load(path, weights_only=True)
    assert "model_state/inc.double_conv.0.weight" in raw[KEY_TENSOR_DIGESTS]
    assert "optimizer/state/0/exp_avg" in raw[KEY_TENSOR_DIGESTS]
    assert load_checkpoint_file(path).keys() == raw.keys()
    # The optimizer state changed after the save, the digests kept: resuming from it would be silently wrong.
    raw["optimizer"]["state"][0]["exp_avg"].add_(1e-3)
    torch.save(raw, path)
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) differ from what was saved \(e.g. optimizer/state/0/"):
        load_checkpoint_file(path)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_weights_are_refused_and_large_finite_ones_are_not(tmp_path: Path, value: float) -> None:
    model = tiny_unet(0)
    with torch.no_grad():
        model.outc.conv.weight.fill_(3e38)  # a float32 sum of these overflows; they are finite all the same
    save_checkpoint_atomic(checkpoint_payload(model), tmp_path / "large.pth")
    assert read_model_weights(tmp_path / "large.pth").state_dict
    with torch.no_grad():
        model.outc.conv.weight[0, 0, 0, 0] = value
    save_checkpoint_atomic(checkpoint_payload(model), tmp_path / "bad.pth")
    with pytest.raises(CheckpointError, match=r"holds NaN or inf weights \(outc.conv.weight\)"):
        read_model_weights(tmp_path / "bad.pth")


# ------------------------------------------------------------------------------ files written by others, and before

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "checkpoints"


def assert_holds_weights(model: torch.nn.Module, saved: dict[str, torch.Tensor], prefix: str = "") -> None:
    """``model`` has exactly the tensors ``saved`` holds (under ``prefix`` + name)."""
    own = model.state_dict()
    assert {prefix + key for key in own} == set(saved)
    for key, tensor in own.items():
        assert torch.equal(tensor, saved[prefix + key]), key


def test_a_format_1_file_written_before_the_inference_record_loads_with_its_scale_and_void(tmp_path: Path) -> None:
    path = FIXTURES / "v1_train.pth"
    raw = torch.load(path, map_location="cpu", weights_only=True)
    assert KEY_INFERENCE not in raw and raw[KEY_FORMAT_VERSION] == 1  # the fixture is what it claims to be
    model, spec = load_model(path)
    assert_holds_weights(model, raw["model_state"])
    assert spec.model_args == {"n_channels": 1, "n_classes": 2, "bilinear": True, "base_channels": 2}
    assert (spec.mask_values, spec.inference.scale, spec.inference.ignore_values) == ([0, 128], 0.25, (255,))
    # It resumes too: the typed read finds the position and the record (from the run's args, for such old files).
    state = TrainingState.of(load_checkpoint_file(path), path)
    assert (state.position.epoch, state.position.global_step, state.position.step_in_epoch) == (1, 10, 0)
    assert state.weights.inference == InferenceRecord(scale=0.25, ignore_values=(255,), channels=1)
    assert state.run_args["scale"] == 0.25 and state.world_size == 1


def test_a_milesial_file_loads_with_its_mask_values_and_milesials_scale() -> None:
    path = FIXTURES / "milesial.pth"
    raw = torch.load(path, map_location="cpu", weights_only=True)
    model, spec = load_model(path)
    assert_holds_weights(model, {key: value for key, value in raw.items() if key != "mask_values"})
    assert spec.model_args == {"n_channels": 3, "n_classes": 3, "bilinear": False, "base_channels": 2}
    assert (spec.mask_values, spec.inference.scale, spec.scale, spec.inference.ignore_values) == (
        [0, 127, 254],
        None,
        0.5,
        (),
    )
    with pytest.raises(CheckpointError, match=r"cannot be resumed: it lacks model_state, optimizer"):
        TrainingState.of(load_checkpoint_file(path), path)


def test_a_ddp_script_file_loads_without_its_module_prefixes() -> None:
    path = FIXTURES / "ddp_script.pth"
    raw = torch.load(path, map_location="cpu", weights_only=True)
    assert raw["epoch"] == 4
    model, spec = load_model(path)
    assert_holds_weights(model, raw["model_state_dict"], prefix="module.")
    assert spec.model_args == {"n_channels": 3, "n_classes": 1, "bilinear": True, "base_channels": 2}
    assert (spec.mask_values, spec.inference.scale) == (None, None)


def test_the_inference_record_decides_how_images_are_prepared_not_the_flags(tmp_path: Path) -> None:
    model = tiny_unet()
    payload = checkpoint_payload(model, [0, 255])
    # A later version may rename or drop the flags: what predict needs is read from the record alone.
    payload[KEY_ARGS] = {"scale": 0.1, "ignore_values": [7], "image_scale": 0.9}
    payload[KEY_INFERENCE] = InferenceRecord(scale=0.75, ignore_values=(255,), channels=3).as_dict()
    save_checkpoint_atomic(payload, tmp_path / "new.pth")
    _, spec = load_model(tmp_path / "new.pth")
    assert (spec.inference.scale, spec.inference.ignore_values, spec.mask_values) == (0.75, (255,), [0, 255])


def test_a_newer_format_is_refused_by_every_read(tmp_path: Path) -> None:
    path = tmp_path / "future.pth"
    shutil.copy(FIXTURES / "v1_train.pth", path)
    payload = load_checkpoint_file(path)
    payload[KEY_FORMAT_VERSION] = FORMAT_VERSION + 1
    save_checkpoint_atomic(payload, path)
    upgrade = rf"{path} has format version {FORMAT_VERSION + 1}; this version of unet-ddp reads up to {FORMAT_VERSION}"
    for read in (read_model_weights, load_resume_checkpoint):
        with pytest.raises(CheckpointError, match=upgrade):
            read(path)


def test_a_training_state_survives_its_own_write_and_read(tmp_path: Path) -> None:
    state = TrainingState.of(load_checkpoint_file(FIXTURES / "v1_train.pth"), "v1_train.pth")
    state.weights.inference = InferenceRecord(scale=0.5, ignore_values=(), channels=1)
    # No field at its default, so a field written under another name than TrainPosition.of reads would show.
    state.position = TrainPosition(3, 30, 2, 0.75, [[0.75, 20], [0.5, 10]], 2, 1)
    save_checkpoint_atomic(state.to_payload(), tmp_path / "again.pth")
    again = TrainingState.of(load_checkpoint_file(tmp_path / "again.pth"), "again.pth")
    assert again.weights.inference == state.weights.inference and again.position == state.position
    assert again.weights.state_dict.keys() == state.weights.state_dict.keys()
    assert all(torch.equal(again.weights.state_dict[key], tensor) for key, tensor in state.weights.state_dict.items())
    assert again.run_args == state.run_args and again.weights.mask_values == state.weights.mask_values


def test_train_writes_the_inference_record(runner: TrainRunner) -> None:
    assert runner.main("record", "-e", "1", "--max-steps", "1", "--ignore-value", "7") == 0
    raw = load_checkpoint_file(runner.run_dir("record") / "last.pth")
    assert raw[KEY_INFERENCE] == {"scale": 1.0, "ignore_values": [7], "channels": 3, "class_names": []}
