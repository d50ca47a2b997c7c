"""A data error raised in a DataLoader worker reaches the user as the same one Error line as in the main process."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from torch.utils.data import Dataset

import evaluate as evaluate_cli
from tests.conftest import REPO_ROOT, child_env
from tests.helpers import make_model, one_error_line, save_checkpoint
from utils.cli import print_error
from utils.errors import DatasetError, user_message
from utils.hardware import SharedMemoryGuard

# A stopped run exits within seconds; far longer means it hangs.
EXIT_TIMEOUT_S = 120


class _Broken(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        raise DatasetError(f"cannot decode img/{index}.png (truncated); replace or delete the file")


def test_an_error_re_raised_from_a_worker_prints_as_its_own_one_line_message_and_the_workers_are_gone(capsys):
    with pytest.raises(DatasetError) as caught:
        next(iter(SharedMemoryGuard(_Broken(), "--workers 0", num_workers=2)))  # the scripts' loader
    # Held with its error (pytest holds it here, in a reference cycle), the iterator has shut its workers down: left
    # to the cyclic garbage collector, it would keep them up until then, and then wait 5 s for each.
    assert not multiprocessing.active_children()
    assert "Caught DatasetError in DataLoader worker process" in Exception.__str__(caught.value)  # PyTorch's wrapper
    message = "cannot decode img/0.png (truncated); replace or delete the file"
    assert str(caught.value) == user_message(caught.value) == message
    print_error(caught.value)
    assert capsys.readouterr().err == f"Error: {message}\n"


def _corrupt_keeping_size_and_mtime(path: Path) -> None:
    """Garble the middle of ``path`` (its pixel data), keeping its size and time stamp.

    The dataset scan's cache is keyed by size and mtime, so a scan made before still counts as valid: the bad file
    passes the scan and fails only when a loader worker decodes it, which is the path under test.
    """
    stat = path.stat()
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(byte ^ 0xFF for byte in data[middle : middle + 64])
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def _png_copy(carvana_data, root: Path) -> tuple[Path, Path]:
    imgs, masks = root / "imgs", root / "masks"
    imgs.mkdir(parents=True)
    for path in sorted(carvana_data.imgs.iterdir()):
        Image.open(path).save(imgs / f"{path.stem}.png")  # PNG checks its data: a garbled file cannot decode
    shutil.copytree(carvana_data.masks, masks)
    return imgs, masks


@pytest.mark.parametrize("workers", [0, 2])
def test_evaluate_reports_an_image_broken_after_the_scan_in_one_line(
    tmp_path, carvana_data, capsys, monkeypatch, workers
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    imgs, masks = _png_copy(carvana_data, tmp_path / "data")
    checkpoint = save_checkpoint(tmp_path / "m.pth", make_model(2), [0, 1])
    argv = ["-m", str(checkpoint), "--imgs", str(imgs), "--masks", str(masks), "--workers", str(workers)]
    assert evaluate_cli.main([*argv, "--no-progress"]) == 0  # the scan, cached
    broken = sorted(imgs.iterdir())[5]
    _corrupt_keeping_size_and_mtime(broken)
    capsys.readouterr()
    assert evaluate_cli.main([*argv, "--no-progress"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"cannot decode {broken}" in line and "Traceback" not in line and "DataLoader" not in line


@pytest.mark.slow
def test_train_with_loader_workers_reports_an_image_broken_after_the_scan_in_one_line(tmp_path, carvana_data, runner):
    imgs, masks = _png_copy(carvana_data, tmp_path / "data")
    env = child_env({"XDG_CACHE_HOME": str(tmp_path / "cache")})

    def train(exp_name: str) -> tuple[int | None, str]:
        args = runner.args(exp_name, "--epochs", "1", "--num-workers", "2")
        args[args.index("--imgs") + 1], args[args.index("--masks") + 1] = str(imgs), str(masks)
        process = subprocess.Popen(
            [sys.executable, "train.py", *args],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: loader workers included, all can be killed at once
        )
        try:
            _, err = process.communicate(timeout=EXIT_TIMEOUT_S)
            return process.returncode, err
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            _, err = process.communicate()
            return None, err

    code, err = train("scan")
    assert code == 0, err[-2000:]
    broken = sorted(imgs.iterdir())[5]
    _corrupt_keeping_size_and_mtime(broken)
    code, err = train("broken")
    line = one_error_line(err)
    assert f"cannot decode {broken}" in line and "Traceback" not in err and "DataLoader" not in line
    # Once hung at exit: the error's traceback kept the loader's iterator, whose workers ignore SIGTERM.
    assert code is not None, "train.py printed its error but did not exit"
    assert code == 2
