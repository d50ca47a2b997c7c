"""Loader workers with too little ``/dev/shm`` (Docker's default is 64 MB): one ``Error:`` line naming the workers
flag and a larger ``/dev/shm``, and no hang, in train.py, predict.py and evaluate.py (``utils.hardware``).

The real cases run each script in its own mount namespace (``unshare -m``) over a 1 MB tmpfs on ``/dev/shm``; they
skip where this machine does not allow that.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch.utils.data import Dataset

from tests.conftest import REPO_ROOT, child_env
from tests.helpers import make_model, one_error_line, save_checkpoint_trained_at, small_tmpfs, write_images
from utils import hardware
from utils.errors import ConfigError
from utils.hardware import PREFETCH_FACTOR, SAFETY_FACTOR, SharedMemoryGuard, guarded_loader, item_bytes

MB = 1024 * 1024


@dataclass
class _Item:
    image: torch.Tensor
    name: str


def test_an_items_bytes_count_every_tensor_of_it() -> None:
    image = torch.zeros(3, 10, 20)  # float32: 2,400 bytes
    mask = torch.zeros(10, 20, dtype=torch.int64)  # 1,600 bytes
    # Each tensor's data, and less than a kilobyte for the rest (the pickle's own records, the names).
    assert 4000 < item_bytes({"image": image, "mask": mask, "name": "a"}) < 5000
    assert 4000 < item_bytes([_Item(image, "a"), (mask,)]) < 5000
    assert 2400 < item_bytes({"image": torch.zeros(6, 10, 20)[:3]}) - 2400 < 3400  # a view: its whole storage
    assert item_bytes(None) < 100


def test_the_room_check_against_a_real_small_filesystem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert (PREFETCH_FACTOR, SAFETY_FACTOR) == (2, 2)
    with small_tmpfs(tmp_path / "shm", "1m") as shm:
        monkeypatch.setattr(hardware, "SHARED_MEMORY_FOLDER", shm)
        stats = os.statvfs(shm)
        free = stats.f_bavail * stats.f_frsize
        assert 0 < free <= MB
        items = [{"image": torch.zeros(free // 16, dtype=torch.uint8)}]  # 1/16 of the room: 2 workers need 1/2
        assert len(guarded_loader(items, batch_size=1, workers=2, workers_fix="--num-workers 0")) == 1
        guarded_loader(items, batch_size=100, workers=0, workers_fix="--num-workers 0")  # no workers
        # Each worker of each process holds PREFETCH_FACTOR batches, SAFETY_FACTOR times: 1/16 * 2 * 2 * 2 * 4 = 2.
        needed = f"need about {2 * free / MB:.0f} MB of {shm}"
        with pytest.raises(ConfigError, match=rf"2 worker\(s\) in each of 4 processes {needed} .*-workers 0.*shm-size"):
            guarded_loader(items, batch_size=1, workers=2, processes=4, workers_fix="--num-workers 0")
        with pytest.raises(ConfigError, match=rf"1 worker\(s\) {needed} for batches of 8 "):
            guarded_loader(items, batch_size=8, workers=1, workers_fix="--num-workers 0")
    # Nothing to check where there is no /dev/shm.
    monkeypatch.setattr(hardware, "SHARED_MEMORY_FOLDER", tmp_path / "missing")
    guarded_loader(items, batch_size=10**6, workers=8, workers_fix="--num-workers 0")


class _FailingDataset(Dataset):
    def __init__(self, message: str) -> None:
        self.message = message

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> int:
        if index == 1:
            raise RuntimeError(self.message)
        return index


def test_guard_turns_a_sharing_failure_into_one_error_and_leaves_others() -> None:
    worker_error = (
        "Caught RuntimeError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
        "RuntimeError: unable to allocate shared memory(shm) for file </torch_1_2>: No space left on device (28)"
    )
    guard = SharedMemoryGuard(_FailingDataset(worker_error), "-j 0", batch_size=1)
    assert len(guard) == 2 and next(iter(guard)).tolist() == [0]
    with pytest.raises(ConfigError, match=r"No space left on device \(28\); use -j 0 .*--shm-size") as raised:
        list(guard)
    assert "\n" not in str(raised.value)
    with pytest.raises(ConfigError, match=r"no batch arrived for 300 s \(a worker lost it.*; use -j 0"):
        list(SharedMemoryGuard(_FailingDataset("DataLoader timed out after 300 seconds"), "-j 0"))
    with pytest.raises(RuntimeError, match="something else"):
        list(SharedMemoryGuard(_FailingDataset("something else"), "-j 0"))


# --- real processes over a 1 MB /dev/shm ---------------------------------------------------------------------------

SHM_SIZE = "1m"
SIZE = (256, 256)  # a batch of 2: 3x256x256 floats each (1.5 MB): more than the whole /dev/shm


def _small_shm_command(args: list[str]) -> list[str]:
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here")
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size={SHM_SIZE} tmpfs /dev/shm"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs on /dev/shm in a mount namespace: {probe.stderr.strip()}")
    mount = f'mount -t tmpfs -o size={SHM_SIZE} tmpfs /dev/shm && exec "$0" "$@"'
    return ["unshare", "-m", "sh", "-c", mount, sys.executable, *args]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            _small_shm_command(args), cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=240
        )
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"hung with a small /dev/shm: {(hung.stderr or b'')[-2000:]!r}")


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return save_checkpoint_trained_at(tmp_path / "model.pth", make_model(), scale=1.0)


@pytest.fixture
def images(tmp_path: Path) -> Path:
    write_images(tmp_path / "imgs", [SIZE] * 6)
    return tmp_path / "imgs"


@pytest.mark.slow
def test_predict_with_workers_and_a_small_shm_says_so(checkpoint: Path, images: Path, tmp_path: Path) -> None:
    result = _run(["predict.py", "-m", str(checkpoint), "-i", str(images), "--output-dir", str(tmp_path / "out"),
                   "-b", "2", "-j", "2", "--no-progress"])  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    line = one_error_line(result.stderr)
    assert "--workers 0 (-j 0)" in line and "/dev/shm" in line and "--shm-size" in line, line
    result = _run(["predict.py", "-m", str(checkpoint), "-i", str(images), "--output-dir", str(tmp_path / "out"),
                   "-b", "2", "-j", "0", "--no-progress"])  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]  # the fix named works
    assert len(list((tmp_path / "out").glob("*_OUT.png"))) == 6


@pytest.mark.slow
def test_evaluate_with_workers_and_a_small_shm_says_so(checkpoint: Path, images: Path, tmp_path: Path) -> None:
    masks = tmp_path / "masks"
    masks.mkdir()
    for image in images.glob("*.png"):
        Image.new("L", SIZE).save(masks / image.name)
    result = _run(["evaluate.py", "-m", str(checkpoint), "--imgs", str(images), "--masks", str(masks),
                   "-b", "2", "-j", "2", "--no-progress"])  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    line = one_error_line(result.stderr)
    assert "--workers 0 (-j 0)" in line and "--shm-size" in line, line


@pytest.mark.slow
def test_train_with_workers_and_a_small_shm_says_so(tmp_path: Path) -> None:
    from utils.datasets.synthetic import generate_carvana_like

    generate_carvana_like(tmp_path / "data", 8, size=SIZE, seed=0)
    result = _run(["train.py", "--imgs", str(tmp_path / "data" / "imgs"), "--masks", str(tmp_path / "data" / "masks"),
                   "--checkpoint-dir", str(tmp_path / "checkpoints"), "--base-channels", "8", "--scale", "1",
                   "--batch-size", "2", "--epochs", "1", "--threads", "1", "--validation", "25",
                   "--num-workers", "2"])  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    line = one_error_line(result.stderr)
    assert "--num-workers 0" in line and "--shm-size" in line, line


# The backstop: the same scripts with the check before the workers start fooled (its estimate falls short: items of
# no bytes), and a short loader timeout. predict's workers lose their batch in their queue's feeder thread (before the
# fix it hung for good): it waits the whole timeout, so its is shorter; train's report the failure from the worker
# (before the fix: a traceback, then a hang at exit), and a slow worker on a busy machine must not time out before that.
WITHOUT_CHECK = """
import runpy, sys
sys.path.insert(0, {root!r})
import utils.hardware as shared_memory
shared_memory.item_bytes = lambda item: 0
shared_memory.LOADER_TIMEOUT_S = {timeout_s}
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _run_without_check(args: list[str], tmp_path: Path, timeout_s: float = 10.0) -> subprocess.CompletedProcess:
    script = tmp_path / "without_check.py"
    script.write_text(WITHOUT_CHECK.format(root=str(REPO_ROOT), timeout_s=timeout_s))
    return _run([str(script), *args])


@pytest.mark.slow
def test_predict_backstop_a_lost_batch_ends_in_one_line(checkpoint: Path, images: Path, tmp_path: Path) -> None:
    result = _run_without_check(["predict.py", "-m", str(checkpoint), "-i", str(images), "--output-dir",
                                 str(tmp_path / "out"), "-b", "2", "-j", "2", "--no-progress"], tmp_path,
                                timeout_s=3.0)  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    line = one_error_line(result.stderr)
    assert "no batch arrived for 3 s" in line and "--workers 0 (-j 0)" in line, line


@pytest.mark.slow
def test_train_backstop_a_worker_failure_ends_in_one_line(tmp_path: Path) -> None:
    from utils.datasets.synthetic import generate_carvana_like

    generate_carvana_like(tmp_path / "data", 8, size=SIZE, seed=0)
    result = _run_without_check(["train.py", "--imgs", str(tmp_path / "data" / "imgs"), "--masks",
                                 str(tmp_path / "data" / "masks"), "--checkpoint-dir", str(tmp_path / "checkpoints"),
                                 "--base-channels", "8", "--scale", "1", "--batch-size", "2", "--epochs", "1",
                                 "--threads", "1", "--validation", "25", "--num-workers", "2"], tmp_path)  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    line = one_error_line(result.stderr)
    assert "No space left on device" in line and "--num-workers 0" in line, line
