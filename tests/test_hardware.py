"""utils.hardware: precision for the device, native bf16 on this CPU, threads per process."""

from __future__ import annotations

import pytest

from tests.helpers import cpu_has_bf16_instructions
from utils.errors import ConfigError
from utils.hardware import cpu_has_native, resolve_precision, threads_per_process


def test_precision_follows_amp_and_device() -> None:
    assert resolve_precision(None, True, "cuda") == "fp16"
    assert resolve_precision(None, True, "cpu") == "bf16"
    assert resolve_precision(None, False, "cpu") == "fp32"
    assert resolve_precision("bf16", False, "cuda") == "bf16"
    with pytest.raises(ConfigError, match="--precision fp16 needs a CUDA device"):
        resolve_precision("fp16", False, "cpu")


def test_native_bf16_agrees_with_the_cpu_flags() -> None:
    assert cpu_has_native("fp32")
    assert cpu_has_native("bf16") == cpu_has_bf16_instructions()


def test_threads_split_the_cores_between_local_processes() -> None:
    assert threads_per_process(2, 2) == 1
    assert threads_per_process(16, 4) == 4
    assert threads_per_process(2, 8) == 1
    assert threads_per_process(8, 1) == 8
