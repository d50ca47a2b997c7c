"""utils.output_files: outputs checked by file identity, written all or nothing; metrics.jsonl survives a torn line."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import zipfile
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.helpers import small_tmpfs
from utils.datasets.dataset import BasicDataset
from utils.errors import ConfigError
from utils.output_files import OutputError, check_outputs, open_for_append, replacing, torch_archive_kind, write_text
from utils.training.curves import read_series, write_curves_if_possible


def fill_disk(folder: Path) -> None:
    """Fill ``folder``'s filesystem to the last byte (unbuffered: a buffered file would fail again on close)."""
    descriptor = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        for block in (65536, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(descriptor, b"\0" * block)
    finally:
        os.close(descriptor)


def test_torch_archives_are_recognised_whatever_their_name(tmp_path):
    weights = {"w": torch.zeros(2)}
    torch.save(weights, tmp_path / "zip.json")
    torch.save(weights, tmp_path / "legacy.png", _use_new_zipfile_serialization=False)
    torch.jit.trace(torch.nn.Linear(2, 2), torch.zeros(1, 2)).save(str(tmp_path / "script.bin"))
    Image.new("L", (4, 4)).save(tmp_path / "image.png")
    with zipfile.ZipFile(tmp_path / "plain.zip", "w") as archive:
        archive.writestr("notes.txt", "hello")
    assert torch_archive_kind(tmp_path / "zip.json") == "checkpoint"
    assert torch_archive_kind(tmp_path / "legacy.png") == "checkpoint"
    assert torch_archive_kind(tmp_path / "script.bin") == "torchscript"
    assert torch_archive_kind(tmp_path / "image.png") is None
    assert torch_archive_kind(tmp_path / "plain.zip") is None


def test_links_to_a_kept_file_are_refused_and_the_message_names_both(tmp_path):
    kept = tmp_path / "photo.png"
    Image.new("RGB", (4, 4)).save(kept)
    hard, soft = tmp_path / "hard.png", tmp_path / "soft.png"
    os.link(kept, hard)
    soft.symlink_to(kept)
    for link in (hard, soft):
        with pytest.raises(ConfigError, match=f"{link}, which is the input {kept}"):
            check_outputs([(link, "the mask")], {kept: "the input"})


def test_two_outputs_that_are_one_file_are_refused(tmp_path):
    first = tmp_path / "a" / "x_OUT.png"
    first.parent.mkdir()
    Image.new("L", (4, 4)).save(first)
    second = tmp_path / "y_OUT.png"
    os.link(first, second)
    with pytest.raises(ConfigError, match="would both be written"):
        check_outputs([(first, "one"), (second, "two")], {})
    spelled_twice = [(tmp_path / "new.png", "one"), (tmp_path / "a" / ".." / "new.png", "two")]
    with pytest.raises(ConfigError, match="would both be written"):
        check_outputs(spelled_twice, {})


def test_existing_images_in_input_folders_are_kept_but_earlier_outputs_are_replaced(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    for name in ("sibling.png", "sibling_OUT.png"):
        Image.new("L", (4, 4)).save(folder / name)
    with pytest.raises(ConfigError, match="an existing image in an input folder"):
        check_outputs([(folder / "sibling.png", "the mask")], {}, [folder])
    check_outputs([(folder / "sibling_OUT.png", "the mask")], {}, [folder])
    with pytest.raises(ConfigError, match="an existing image"):
        check_outputs([(folder / "sibling_OUT.png", "--json")], {}, writes_images=False)


def test_a_checkpoint_is_kept_under_any_name_and_torchscript_only_by_exports(tmp_path):
    torch.save({"w": torch.zeros(1)}, tmp_path / "weights.bin")
    with pytest.raises(ConfigError, match="an existing checkpoint"):
        check_outputs([(tmp_path / "weights.bin", "--json")], {}, writes_images=False)
    torch.jit.trace(torch.nn.Linear(2, 2), torch.zeros(1, 2)).save(str(tmp_path / "model.pt"))
    with pytest.raises(ConfigError, match="an existing TorchScript model"):
        check_outputs([(tmp_path / "model.pt", "--json")], {}, writes_images=False)
    check_outputs([(tmp_path / "model.pt", "--export")], {}, writes_images=False, replaces_torchscript=True)


def test_a_link_at_the_output_path_is_replaced_not_written_through(tmp_path):
    target = tmp_path / "target.txt"
    target.write_text("keep me")
    link = tmp_path / "out.txt"
    link.symlink_to(target)
    write_text(link, "new")
    assert target.read_text() == "keep me"
    assert not link.is_symlink() and link.read_text() == "new"


def test_new_outputs_get_the_permissions_of_any_new_file(tmp_path):
    previous = os.umask(0o022)
    try:
        write_text(tmp_path / "scores.json", "{}")
    finally:
        os.umask(previous)
    assert (tmp_path / "scores.json").stat().st_mode & 0o777 == 0o644


def test_a_write_that_fails_leaves_the_previous_file_and_no_temporary(tmp_path):
    path = tmp_path / "mask.png"
    path.write_bytes(b"previous")
    with pytest.raises(ValueError, match="encoder broke"), replacing(path) as temporary:
        temporary.write_bytes(b"half a fi")
        raise ValueError("encoder broke")
    assert path.read_bytes() == b"previous"
    assert sorted(tmp_path.iterdir()) == [path]


def test_a_full_disk_is_one_output_error_and_leaves_the_previous_file(tmp_path):
    with small_tmpfs(tmp_path / "small", "256k") as folder:
        path = folder / "scores.json"
        path.write_text("previous")
        fill_disk(folder)
        with pytest.raises(OutputError, match=f"cannot write --json to {path}: No space left on device") as caught:
            write_text(path, "x" * 100_000, role="--json")
        assert caught.value.location_failure
        assert path.read_text() == "previous"
        assert sorted(p.name for p in folder.iterdir()) == ["filler", "scores.json"]


def test_curves_on_a_full_disk_warn_and_leave_no_temporary(tmp_path, caplog):
    with small_tmpfs(tmp_path / "small", "256k") as folder:
        metrics = folder / "metrics.jsonl"
        metrics.write_text(json.dumps({"event": "train", "global_step": 1, "loss": 0.5}) + "\n")
        fill_disk(folder)
        with caplog.at_level(logging.WARNING):
            assert write_curves_if_possible(metrics, folder / "curves.png") is False
        assert "training continues" in caplog.text
        assert sorted(p.name for p in folder.iterdir()) == ["filler", "metrics.jsonl"]


@pytest.mark.parametrize("torn", ['{"event": "train", "glo', "12"])
def test_a_torn_last_metrics_line_is_dropped_with_one_warning(tmp_path, caplog, torn):
    metrics = tmp_path / "metrics.jsonl"
    first = {"event": "train", "global_step": 1, "loss": 0.5}
    metrics.write_text(json.dumps(first) + "\n" + torn)
    with caplog.at_level(logging.WARNING), open_for_append(metrics) as handle:
        handle.write(json.dumps({"event": "train", "global_step": 2, "loss": 0.25}) + "\n")
    assert caplog.text.count("torn line") == 1
    assert read_series(metrics).loss == [(1, 0.5), (2, 0.25)]
    lines = metrics.read_text().splitlines()
    assert len(lines) == 2 and all(isinstance(json.loads(line), dict) for line in lines), lines


def test_a_last_record_that_lost_only_its_newline_is_kept(tmp_path, caplog):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"a": 1}\n{"b": 2}')
    with caplog.at_level(logging.WARNING), open_for_append(metrics) as handle:
        handle.write('{"c": 3}\n')
    assert metrics.read_text() == '{"a": 1}\n{"b": 2}\n{"c": 3}\n'
    assert "ended without a newline" in caplog.text


def test_a_file_that_is_one_torn_line_becomes_empty(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"event": "tr')
    open_for_append(metrics).close()
    assert metrics.read_text() == ""


def test_a_complete_metrics_file_is_appended_to_as_it_is(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"a": 1}\n')
    with open_for_append(metrics) as handle:
        handle.write('{"b": 2}\n')
    assert metrics.read_text() == '{"a": 1}\n{"b": 2}\n'


def test_images_and_masks_in_one_folder_are_refused_through_a_link(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    Image.new("RGB", (8, 8)).save(folder / "a.png")
    (tmp_path / "alias").symlink_to(folder, target_is_directory=True)
    with pytest.raises(ConfigError, match="are one folder; give the masks their own folder"):
        BasicDataset(folder, tmp_path / "alias", 1.0)
