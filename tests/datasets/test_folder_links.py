"""A link loop or a dangling link in imgs/ or masks/: one line naming the link, in train.py and in the dataset check."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import SyntheticData, TrainRunner
from tests.helpers import one_error_line
from utils.datasets.check import main as check_main
from utils.datasets.image_files import index_folder
from utils.errors import USER_ERROR_EXIT_CODE, DatasetError


def _data_with_link(carvana_data: SyntheticData, tmp_path: Path, folder: str, kind: str) -> tuple[SyntheticData, str]:
    root = tmp_path / "data"
    shutil.copytree(carvana_data.imgs, root / "imgs")
    shutil.copytree(carvana_data.masks, root / "masks")
    name = "zz_loop.jpg" if folder == "imgs" else "zz_loop_mask.gif"
    link = root / folder / name
    if kind == "loop":
        os.symlink(link.name, link)  # the link points at itself: ELOOP when followed
    else:
        os.symlink(root / "gone.jpg", link)
    return SyntheticData(root / "imgs", root / "masks", carvana_data.n_images), name


@pytest.mark.parametrize("folder", ["imgs", "masks"])
@pytest.mark.parametrize("kind", ["loop", "dangling"])
def test_a_bad_link_is_one_line_naming_it(carvana_data, tmp_path: Path, capsys, folder: str, kind: str) -> None:
    data, name = _data_with_link(carvana_data, tmp_path, folder, kind)
    expected = "Too many levels of symbolic links" if kind == "loop" else "gone.jpg (no such file)"
    runner = TrainRunner(data, tmp_path / "checkpoints")
    assert runner.main("links", "--epochs", "1") == USER_ERROR_EXIT_CODE
    line = one_error_line(capsys.readouterr().err)
    role, path = ("image", data.imgs) if folder == "imgs" else ("mask", data.masks)
    assert f"1 link(s) in {role} folder {path} lead to no file: {name}" in line, line
    assert name in line and expected in line and line.endswith("fix or remove the link(s)"), line
    check_args = ["--imgs", str(data.imgs), "--masks", str(data.masks), "--cache-dir", str(tmp_path / "cache")]
    assert check_main(check_args) == USER_ERROR_EXIT_CODE
    check_line = one_error_line(capsys.readouterr().err)
    assert name in check_line and expected in check_line, check_line


def test_links_to_files_and_unrelated_broken_links_are_fine(carvana_data, tmp_path: Path) -> None:
    data, _ = _data_with_link(carvana_data, tmp_path, "imgs", "dangling")
    (data.imgs / "zz_loop.jpg").unlink()
    first = sorted(data.imgs.iterdir())[0]
    os.symlink(first, data.imgs / "linked.jpg")  # a link to a real file is a file
    os.symlink(data.imgs / "missing.txt", data.imgs / "notes.txt")  # not a name the index takes: not its business
    index = index_folder(data.imgs, "image")
    assert index["linked"].path == str(data.imgs / "linked.jpg") and "notes" not in index
    os.symlink("self.png", data.imgs / "self.png")
    with pytest.raises(DatasetError, match=r"1 link\(s\) in image folder .* lead to no file: self\.png \("):
        index_folder(data.imgs, "image")
