"""utils.hardware: glibc keeps large freed buffers for reuse; loader workers ask for it."""

from __future__ import annotations

import platform

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from utils.hardware import reuse_large_buffers
from utils.training import data as training_data


class _Settings(Dataset):
    """Reports, from inside the loader worker, whether the worker's malloc accepts the settings again."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, int(reuse_large_buffers())])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_glibc_takes_the_settings_and_loader_workers_initialise_with_them() -> None:
    assert reuse_large_buffers() is True
    assert reuse_large_buffers() is True, "idempotent"
    loader = DataLoader(_Settings(), batch_size=2, num_workers=1, worker_init_fn=training_data._init_loader_worker)
    (batch,) = list(loader)
    assert batch.tolist() == [[0, 1], [1, 1]]
