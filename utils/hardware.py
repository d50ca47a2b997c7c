"""The machine: which device to use, how many CPUs this process may use, and what each precision means on it.

The one owner of these facts for training, inference, evaluation and the benchmark, so that ``--precision bf16`` or
``--device auto`` mean the same thing everywhere.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from utils.errors import ConfigError

logger = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("auto", "cuda", "mps", "cpu")
_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of ``precision``; None for fp32, which runs without autocast."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    return _AUTOCAST_DTYPES.get(precision)


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the heavy maths runs in under ``precision`` (fp32 for fp32)."""
    return autocast_dtype(precision) or torch.float32


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed precision for a forward pass on ``device``; fp32 runs without autocast."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def resolve_precision(precision: str | None, amp: bool, device_type: str) -> str:
    """The precision to run: ``precision`` if given, else ``--amp``'s choice for the device, else fp32."""
    if precision is None:
        # fp16 needs a gradient scaler, which only CUDA has in every PyTorch version; bf16 needs none.
        precision = ("fp16" if device_type == "cuda" else "bf16") if amp else "fp32"
    if precision == "fp16" and device_type != "cuda":
        raise ConfigError(f"--precision fp16 needs a CUDA device (running on {device_type}); use --precision bf16")
    return precision


def cpu_has_native(precision: str) -> bool:
    """Whether this CPU has instructions for ``precision`` (fp32 always); without them half precision is emulated."""
    if precision == "fp32":
        return True
    probes = (
        ("_is_avx512_bf16_supported", "_is_amx_tile_supported") if precision == "bf16" else ("_is_amx_fp16_supported",)
    )
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def warn_if_emulated(device: torch.device, precision: str) -> bool:
    """One warning when ``precision`` would be emulated on this CPU (about 5x slower than fp32); True if it warned."""
    if device.type != "cpu" or cpu_has_native(precision):
        return False
    logger.warning(
        "%s on this CPU is emulated (no AVX-512 BF16/AMX instructions) and runs about 5x slower than fp32 "
        "(docs/PERFORMANCE.md); use --precision fp32 here",
        precision,
    )
    return True


def pick_device(requested: str, *, local_rank: int = 0, distributed: bool = False) -> torch.device:
    """The device for ``requested`` (auto, cpu, cuda, cuda:N, mps).

    ``auto`` is cuda:LOCAL_RANK when CUDA is there, else MPS for a single process, else the CPU. A device that is
    asked for but absent is a ConfigError naming ``--device``.
    """
    try:
        device = torch.device("cuda" if requested == "auto" else requested)
    except RuntimeError:
        raise ConfigError(f"--device {requested!r} is not a device; use auto, cpu, cuda, cuda:N or mps") from None
    cuda_ok = torch.cuda.is_available()
    mps_ok = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if requested != "auto" and device.type == "cuda" and not cuda_ok:
        raise ConfigError(f"--device {requested} but PyTorch sees no CUDA device; use --device cpu (or auto)")
    if device.type == "mps" and not mps_ok:
        raise ConfigError("--device mps but MPS is not available here; use --device cpu (or auto)")
    if device.type == "cuda" and device.index is not None and distributed:
        raise ConfigError(
            f"--device {requested} would put every process on GPU {device.index}; use --device cuda (each process "
            "takes cuda:LOCAL_RANK)"
        )
    if device.type == "mps" and distributed:
        raise ConfigError("DDP does not run on MPS; use --device cpu for a distributed run on this machine")
    if device.type == "cuda" and cuda_ok:
        index = device.index if device.index is not None else local_rank
        count = torch.cuda.device_count()
        if index >= count:
            raise ConfigError(
                f"process with local rank {local_rank} needs GPU {index} but only {count} are visible; start at most "
                f"{count} processes per machine (--nproc_per_node), and in a manual launch give each process its GPU "
                f"with --local-rank (or LOCAL_RANK)"
            )
        return torch.device("cuda", index)
    if requested == "auto" and mps_ok and not distributed:
        return torch.device("mps")
    if requested == "auto":
        return torch.device("cpu")
    return device


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which a container or SLURM may narrow), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_process(cpu_count: int, local_world_size: int) -> int:
    """CPU threads per process so that the processes of one machine together use each core once."""
    return max(1, cpu_count // max(1, local_world_size))
