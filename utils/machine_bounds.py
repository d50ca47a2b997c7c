"""Upper bounds that come from the machine rather than from a flag's meaning: threads, loader workers, model size.

A flag's ``Range`` (``utils.flags``) knows what a value means; how many threads or processes this machine
can run, or whether a model fits its memory, only the machine knows. Each check here runs before anything is built
or created (no run folder, no model), and its error names the flag, the bound and where the bound comes from.
"""

from __future__ import annotations

import os

import torch

from utils.errors import ConfigError
from utils.hardware import available_cpus

# More threads than 4 per CPU only adds contention; past some thousands OpenMP's thread pool fails to start (a
# segfault, not an error). Workers are processes: a handful per CPU keeps a GPU fed, thousands exhaust the PID table.
THREADS_PER_CPU = 4
WORKERS_PER_CPU = 4
MIN_WORKERS_BOUND = 16
"""Workers allowed on any machine, however few its CPUs (decoding waits on the disk too)."""
BYTES_PER_WEIGHT = 4  # fp32, as the model is built before it moves to a device or a precision


def check_threads(threads: int, flag: str = "--threads") -> None:
    """At most ``THREADS_PER_CPU`` threads per CPU this process may use."""
    bound = THREADS_PER_CPU * available_cpus()
    if threads > bound:
        raise ConfigError(
            f"{flag} {threads} is more than {THREADS_PER_CPU} per CPU this process may use ({available_cpus()} "
            f"CPUs, so at most {bound}); use 0 (one per CPU) or a number up to {bound}"
        )


def check_workers(workers: int, flag: str) -> None:
    """At most ``WORKERS_PER_CPU`` loader processes per CPU (``MIN_WORKERS_BOUND`` on any machine)."""
    bound = max(MIN_WORKERS_BOUND, WORKERS_PER_CPU * available_cpus())
    if workers > bound:
        raise ConfigError(
            f"{flag} {workers} would start {workers} loader processes per training process on {available_cpus()} "
            f"CPUs; use at most {bound} (0 loads in the main process)"
        )


def model_parameters(n_channels: int, n_classes: int, *, bilinear: bool, base_channels: int) -> int:
    """The UNet's number of weights and buffers, counted on the meta device (nothing is allocated)."""
    from unet import UNet  # the model package imports torch's nn stack: only needed when counting

    with torch.device("meta"):
        model = UNet(n_channels, n_classes, bilinear=bilinear, base_channels=base_channels)
    return sum(tensor.numel() for tensor in [*model.parameters(), *model.buffers()])


def machine_memory_bytes() -> int | None:
    """This machine's memory as this process may use it (physical RAM, narrowed by a cgroup limit); None if unknown."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()  # noqa: SIM115 - one small read
    except OSError:
        limit = "max"
    return min(total, int(limit)) if limit.isdigit() else total


def check_model_fits(n_channels: int, n_classes: int, *, bilinear: bool, base_channels: int) -> None:
    """Refuse a UNet whose fp32 weights alone exceed this machine's memory (it is built in RAM before anything else;
    training needs about four times that: weights, gradients and two optimizer moments)."""
    memory = machine_memory_bytes()
    if memory is None:
        return
    count = model_parameters(n_channels, n_classes, bilinear=bilinear, base_channels=base_channels)
    needed = count * BYTES_PER_WEIGHT
    if needed > memory:
        raise ConfigError(
            f"--base-channels {base_channels} makes a UNet of {count:.3g} weights, {_gib(needed)} in fp32 (about "
            f"{_gib(4 * needed)} to train), more than this machine's {_gib(memory)} of memory; use a smaller "
            f"--base-channels (64 is the classic model, {_gib(4 * 31_000_000 * BYTES_PER_WEIGHT)} to train)"
        )


def _gib(size: int) -> str:
    return f"{size / 2**30:,.1f} GiB"
