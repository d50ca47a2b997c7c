"""Helpers shared by test files (fixtures live in conftest.py): output checks, files and checkpoints to test with."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import struct
import subprocess
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from unet import UNet
from utils.checkpoint.files import save_checkpoint_atomic
from utils.checkpoint.format import FORMAT_VERSION, KEY_FORMAT_VERSION, KEY_MASK_VALUES, KEY_MODEL, KEY_MODEL_ARGS
from utils.datasets.dataset import image_tensor
from utils.launch.process_group import DistributedContext

CPU_CONTEXT = DistributedContext(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
"""One process on the CPU, as ``utils.launch.process_group.setup`` returns it without a launcher."""


def positive(value: object) -> bool:
    """A reported figure that exists: a number above zero (the benchmark's tests assert no speeds)."""
    return isinstance(value, int | float) and value > 0


def one_error_line(err: str) -> str:
    """The one ``Error:`` line of ``err`` (a process's stderr), which must also be its last line; returns it.

    Progress bars share stderr, so other lines may come before it, but no second ``Error:`` line may.
    """
    lines = err.strip().splitlines()
    assert lines, "stderr is empty: no error was reported"
    assert [line for line in lines if line.startswith("Error: ")] == lines[-1:], err
    return lines[-1]


def torchrun_root_cause(output: str) -> str:
    """torchrun's "Root Cause (first observed failure)" section of its ChildFailedError summary."""
    assert "ChildFailedError" in output, output
    return output.split("Root Cause (first observed failure):", 1)[1]


def names_rank_0_with_status_2(cause: str) -> bool:
    """Whether a torchrun root cause is global rank 0 ending with the user-error status (2): the rank that printed a
    shared error, leaving before the others."""
    return bool(re.search(r"rank\s*: 0 ", cause) and re.search(r"exitcode\s*: 2 ", cause))


METRICS_FILE = "metrics.jsonl"  # the documented name in a run folder (README); the tests' one spelling of it


def read_metrics(run_dir_or_path: Path, *, event: str | None = None, partial_ok: bool = False) -> list[dict]:
    """The events of a run's ``metrics.jsonl`` (a run folder or the file itself), optionally only those of ``event``.

    With ``partial_ok`` (a run still writing) a last line without its end is ignored; every other line must parse.
    """
    path = Path(run_dir_or_path)
    if path.is_dir():
        path = path / METRICS_FILE
    text = path.read_text()
    lines = text.splitlines()
    if partial_ok and lines and not text.endswith("\n"):
        lines = lines[:-1]
    events = [json.loads(line) for line in lines]
    return [record for record in events if event is None or record["event"] == event]


class RunsCodeWhenUnpickled:
    """A hostile payload: unpickling it calls ``os.system`` to create ``marker``, as a trojan checkpoint would."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def write_trojan_checkpoint(path: Path, marker: Path) -> Path:
    """A file that looks like one of our checkpoints but runs a command (creating ``marker``) when unpickled."""
    weights = torch.nn.Linear(2, 2).state_dict()
    torch.save({"format_version": 1, "model_state": weights, "epoch": 1, "hook": RunsCodeWhenUnpickled(marker)}, path)
    return path


def tiny_unet(seed: int = 0, *, n_channels: int = 3, n_classes: int = 2, **kwargs: Any) -> UNet:
    """A small UNet (base_channels=8) with weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return UNet(n_channels, n_classes, base_channels=8, **kwargs)


def checkpoint_payload(model: UNet, mask_values: Sequence | None = (0, 1)) -> dict[str, Any]:
    """Our checkpoint format with model weights only (what ``predict.py`` and ``--load`` need)."""
    payload: dict[str, Any] = {
        KEY_FORMAT_VERSION: FORMAT_VERSION,
        KEY_MODEL: model.state_dict(),
        KEY_MODEL_ARGS: model.constructor_args(),
    }
    if mask_values is not None:
        payload[KEY_MASK_VALUES] = list(mask_values)
    return payload


def save_checkpoint(path: Path, model: UNet, mask_values: Sequence | None, style: str = "ours") -> Path:
    """Our format, milesial's (bare state_dict + 'mask_values') or a DDP script's ('module.' prefixes)."""
    state = model.state_dict()
    if style == "ours":
        payload = checkpoint_payload(model, mask_values)
    elif style == "milesial":
        payload = dict(state)
    elif style == "ddp":
        payload = {f"module.{key}": value for key, value in state.items()}
    else:
        raise ValueError(style)
    if mask_values is not None:
        payload["mask_values"] = list(mask_values)
    if style == "ours":
        save_checkpoint_atomic(payload, path)  # with its tensor digests, as every file of our format
    else:
        torch.save(payload, path)
    return path


@contextlib.contextmanager
def unwritable_folder(folder: Path) -> Iterator[str]:
    """``folder`` refuses new files inside the block, as root too; yields the OS's message for a refused file.

    Permission bits where they bind; the immutable flag (``chattr +i``) for root, who ignores permission bits. Skips
    the test, saying why, where neither works.
    """
    if os.geteuid() != 0:
        mode = folder.stat().st_mode
        folder.chmod(0o500)

        def unlock() -> None:
            folder.chmod(mode)
    else:
        if shutil.which("chattr") is None:
            pytest.skip("root ignores permission bits and chattr (for an immutable folder) is not installed")
        locked = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
        if locked.returncode != 0:
            pytest.skip(f"root ignores permission bits and this filesystem has no immutable flag: {locked.stderr}")

        def unlock() -> None:
            subprocess.run(["chattr", "-i", str(folder)], check=True)

    try:
        probe = folder / ".write-probe"
        try:
            probe.touch()
        except OSError as error:
            message = error.strerror
        else:
            probe.unlink()
            raise AssertionError(f"{folder} still accepts new files")
        yield message
    finally:
        unlock()


def cpu_has_bf16_instructions() -> bool:
    """Whether /proc/cpuinfo lists AVX-512 BF16 or AMX-BF16 (x86): an oracle independent of torch's probes.

    Skips the test where /proc/cpuinfo is absent or lists no x86 ``flags``.
    """
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to read the CPU's instruction sets from")
    flags = set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags") and ":" in line:
            flags.update(line.split(":", 1)[1].split())
    if not flags:
        pytest.skip("/proc/cpuinfo lists no x86 flags (another architecture)")
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def structured_image(width: int, height: int, seed: int = 0) -> np.ndarray:
    """RGB uint8 pixels with smooth shapes, so an untrained model predicts regions rather than noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    phase = rng.uniform(0, 6, size=3)
    channels = [np.sin(7 * x + 3 * y + phase[0]), np.cos(5 * y - 2 * x + phase[1]), np.sin(9 * x * y + phase[2])]
    return ((np.stack(channels, axis=-1) * 0.5 + 0.5) * 255).astype(np.uint8)


def write_images(folder: Path, sizes: Sequence[tuple[int, int]], ext: str = ".png", seed: int = 0) -> list[Path]:
    """``img00<ext>``, ``img01<ext>``, ... in ``folder``: one ``structured_image`` per ``(width, height)``."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, (width, height) in enumerate(sizes):
        path = folder / f"img{index:02d}{ext}"
        Image.fromarray(structured_image(width, height, seed + index)).save(path)
        paths.append(path)
    return paths


@torch.no_grad()
def make_model(n_classes: int = 2, *, bilinear: bool = False, seed: int = 0) -> UNet:
    """An untrained tiny UNet whose output bias is set so that every class wins on part of a test image."""
    torch.manual_seed(seed)
    model = UNet(3, n_classes, bilinear=bilinear, base_channels=8).eval()
    logits = model(torch.from_numpy(structured_image(64, 48, seed=99)).permute(2, 0, 1)[None].float() / 255)
    if n_classes == 1:
        model.outc.conv.bias -= logits.median()
    else:
        model.outc.conv.bias -= logits.mean(dim=(0, 2, 3))
    return model


@torch.inference_mode()
def reference_classes(model: UNet, path: Path, scale: float, threshold: float = 0.5) -> np.ndarray:
    """milesial's predict_img, one image at a time: resize, forward, logits to the original size, decide."""
    image = Image.open(path)
    logits = model(image_tensor(image, scale)[None])
    logits = F.interpolate(logits, (image.height, image.width), mode="bilinear")
    if model.n_classes == 1:
        return (torch.sigmoid(logits[0, 0]) > threshold).numpy().astype(np.uint8)
    return logits[0].argmax(dim=0).numpy().astype(np.uint8)


def read_classes(path: Path, mask_values: list) -> np.ndarray:
    """Class indices of a written mask, by looking each pixel's value up in ``mask_values``."""
    pixels = np.asarray(Image.open(path))
    if pixels.dtype == bool:
        pixels = pixels.astype(np.int64)
    classes = np.full(pixels.shape[:2], -1, dtype=np.int64)
    for index, value in enumerate(mask_values):
        match = np.all(pixels == np.asarray(value), axis=-1) if pixels.ndim == 3 else pixels == value
        classes[match] = index
    assert (classes >= 0).all(), "the mask holds values that are not mask_values"
    return classes


def flip_tensor_bytes(path: Path, count: int = 64) -> str:
    """Invert ``count`` bytes in the middle of the largest tensor record of a torch checkpoint, in place.

    The zip's CRC then no longer matches, which ``torch.load`` does not check: the file still loads. Returns the name
    of the changed record.
    """
    with zipfile.ZipFile(path) as archive:
        record = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as handle:
        handle.seek(record.header_offset)
        name_length, extra_length = struct.unpack("<HH", handle.read(30)[26:30])
        start = record.header_offset + 30 + name_length + extra_length + record.file_size // 2
        handle.seek(start)
        original = handle.read(count)
        handle.seek(start)
        handle.write(bytes(byte ^ 0xFF for byte in original))
    return record.filename


@contextlib.contextmanager
def small_tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """A real filesystem of ``size`` (e.g. "3m") mounted at ``mount_point`` inside the block; skips without mount."""
    mount_point.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def fill_disk(folder: Path) -> None:
    """Write a file into ``folder`` until its filesystem has no space left."""
    with open(folder / "filler", "wb") as handle:
        try:
            while True:
                handle.write(b"\0" * 65536)
                handle.flush()
        except OSError as error:
            assert error.errno == errno.ENOSPC, error
    with contextlib.suppress(OSError):  # the last partial block
        with open(folder / "filler2", "wb") as handle:
            while True:
                handle.write(b"\0")
                handle.flush()


def save_checkpoint_trained_at(
    path: Path, model: UNet, scale: float, mask_values: Sequence | None = (0, 1), **run_args: Any
) -> Path:
    """Our format with the run's ``args["scale"]`` (and any other ``run_args``) recorded, as ``train.py`` writes it."""
    payload = checkpoint_payload(model, mask_values)
    payload["args"] = {"scale": scale, **run_args}
    save_checkpoint_atomic(payload, path)
    return path


def paint_void_borders(masks_dir: Path, width: int = 2, value: int = 255) -> int:
    """Set a ``width``-pixel frame of every grey PNG mask in ``masks_dir`` to ``value`` (a VOC-style void label);
    returns the number of void pixels painted."""
    painted = 0
    for path in sorted(masks_dir.glob("*.png")):
        with Image.open(path) as img:
            labels = np.array(img)
        frame = np.ones(labels.shape, dtype=bool)
        frame[width:-width, width:-width] = False
        labels[frame] = value
        painted += int(frame.sum())
        Image.fromarray(labels).save(path)
    return painted


def launch_flags(**flags: Any) -> Any:
    """The distributed flags ``plan_launch`` reads (``--ddp_mode``, ``--rank``, ...), without a command line."""
    return SimpleNamespace(
        **{
            "ddp_mode": False,
            "rank": None,
            "world_size": None,
            "dist_url": None,
            "local_rank": None,
            "requeue_signal": "USR1",
            **flags,
        }
    )


def fake_scontrol(folder: Path, *, exit_status: int = 0) -> Path:
    """A ``scontrol`` that appends its arguments to ``folder/scontrol.calls`` and exits with ``exit_status``."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> "{folder}/scontrol.calls"\nexit {exit_status}\n')
    script.chmod(0o755)
    return folder / "scontrol.calls"


def tensorboard_reader(run_dir: Path) -> Any:
    """What TensorBoard shows of the run: its reader, which applies the writers' purge records."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    reader.Reload()
    return reader


def tensorboard_scalars(reader: Any, tag: str) -> list[tuple[int, float]]:
    return [(event.step, event.value) for event in reader.Scalars(tag)]
