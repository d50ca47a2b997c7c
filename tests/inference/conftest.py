"""Fixtures of the predict/evaluate/export tests: one torch thread, a folder of mixed-size images, a binary model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import make_model, save_checkpoint, write_images

MIXED_SIZES = [(48, 32), (64, 48), (48, 32), (56, 40)]
"""``(width, height)`` of the ``images`` fixture's files: two share a size, so batches mix and match."""


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from threads, and on a busy machine two OpenMP threads made these tests 3x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def images(tmp_path: Path) -> list[Path]:
    return write_images(tmp_path / "in", MIXED_SIZES)


@pytest.fixture
def binary_checkpoint(tmp_path: Path) -> Path:
    return save_checkpoint(tmp_path / "model.pth", make_model(2), [0, 1])
