"""The machine: which device to use, how many CPUs this process may use, and what each precision means on it.

The one owner of these facts for training, inference, evaluation and the benchmark, so that ``--precision bf16`` or
``--device auto`` mean the same thing everywhere.

Memory (``reuse_large_buffers``): large buffers served from the heap and reused, instead of fresh pages from the
kernel for every item. glibc's ``malloc`` maps each allocation above its mmap threshold (128 KiB, growing to at most
32 MiB as buffers are
freed) straight from the kernel and unmaps it when freed, so a loader worker that makes the same few megabyte-sized
tensors for every item (the float image, the colour-mapped copy, the int64 mask) pays page faults for all of their
pages every time. On the 2-core VM of docs/PERFORMANCE.md that was more than half of a cached, augmented 959x640 item
(15 ms against 6.3 ms with the buffers reused). Raising the thresholds keeps freed memory in the heap for the next
item; the process's memory then stays at its peak, which is what a loader worker's is anyway. A training process
makes the same activations at every step: ``train.py`` asks for the same at start-up (bf16 compute-only 2.9 -> 3.7
images/s on that machine, docs/PERFORMANCE.md).

Bounds (``check_threads``, ``check_workers``, ``check_model_fits``): upper bounds that come from the machine rather
than from a flag's meaning (threads, loader workers, model size). A flag's ``range=`` (``utils.flags``) knows what a
value means; how many threads or processes this machine
can run, or whether a model fits its memory, only the machine knows. Each check here runs before anything is built
or created (no run folder, no model), and its error names the flag, the bound and where the bound comes from.

Shared memory (``guarded_loader``, the one loader builder of train.py, predict.py and evaluate.py): room in
``/dev/shm`` for loader workers, checked before they start, and their shared-memory failures as one line. A
``DataLoader`` worker hands each batch to the main process through POSIX shared memory (files in ``/dev/shm`` on
Linux). Docker gives a container 64 MB there by default: a worker that cannot allocate prints a traceback from its
queue's feeder thread and the batch never arrives, so the main process waits for ever. So the loader

- estimates what its workers keep in flight from one real item (``item_bytes``) and refuses to start them when
  ``/dev/shm`` has less free, with one ``Error:`` line naming the workers flag and the larger ``/dev/shm`` that fix
  it;
- waits ``LOADER_TIMEOUT_S`` for a batch (a batch that never comes becomes an error, not a hang) and turns that
  error, and a worker's own shared-memory error, into the same line (``SharedMemoryGuard``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import re
import resource
import shutil
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset

from utils.errors import ConfigError, user_message

if TYPE_CHECKING:
    from unet import UNetArgs

logger = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "fp16")
_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# torch.cpu's probes of the instructions that run each half precision natively (AVX-512 BF16 or AMX).
_NATIVE_PROBES = {"bf16": ("_is_avx512_bf16_supported", "_is_amx_tile_supported"), "fp16": ("_is_amx_fp16_supported",)}


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the heavy maths runs in under ``precision`` (one of ``PRECISIONS``, the flags' choices)."""
    return _AUTOCAST_DTYPES.get(precision, torch.float32)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed precision for a forward pass on ``device``; fp32 runs without autocast."""
    dtype = _AUTOCAST_DTYPES.get(precision)
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


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
    probes = _NATIVE_PROBES.get(precision, ())
    return precision == "fp32" or any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def warn_if_emulated(device: torch.device, precision: str) -> None:
    """One warning when ``precision`` would be emulated on this CPU (about 5x slower than fp32)."""
    if device.type == "cpu" and not cpu_has_native(precision):
        logger.warning(
            "%s on this CPU is emulated (no AVX-512 BF16/AMX instructions) and runs about 5x slower than fp32 "
            "(docs/PERFORMANCE.md); use --precision fp32 here",
            precision,
        )


def pick_device(requested: str, *, local_rank: int = 0, distributed: bool = False) -> torch.device:
    """The device for ``requested`` (auto, cpu, cuda, cuda:N, mps).

    ``auto`` is cuda:LOCAL_RANK when CUDA is there, else MPS for a single process, else the CPU. A device that is
    asked for but absent is a ConfigError naming ``--device``. ``requested`` was checked by ``--device``'s value type
    (``utils.cli.device_flag``).
    """
    cuda_ok = torch.cuda.is_available()
    mps_ok = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if requested == "auto":
        requested = "cuda" if cuda_ok else "mps" if mps_ok and not distributed else "cpu"
    device = torch.device(requested)
    if device.type == "cuda" and not cuda_ok:
        raise ConfigError(f"--device {requested} but PyTorch sees no CUDA device; use --device cpu (or auto)")
    if device.type == "mps" and not mps_ok:
        raise ConfigError("--device mps but MPS is not available here; use --device cpu (or auto)")
    if device.type == "mps" and distributed:
        raise ConfigError("DDP does not run on MPS; use --device cpu for a distributed run on this machine")
    if device.type != "cuda":
        return device
    if device.index is not None and distributed:
        raise ConfigError(
            f"--device {requested} would put every process on GPU {device.index}; use --device cuda (each process "
            "takes cuda:LOCAL_RANK)"
        )
    index = local_rank if device.index is None else device.index
    if index >= (count := torch.cuda.device_count()):
        raise ConfigError(
            f"process with local rank {local_rank} needs GPU {index} but only {count} are visible; start at most "
            f"{count} processes per machine (--nproc_per_node), and in a manual launch give each process its GPU "
            f"with --local-rank (or LOCAL_RANK)"
        )
    return torch.device("cuda", index)


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which a container or SLURM may narrow), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_process(cpu_count: int, local_world_size: int) -> int:
    """CPU threads per process so that the processes of one machine together use each core once."""
    return max(1, cpu_count // max(1, local_world_size))


# ----------------------------------------------------------------------------------------------------
# memory reuse for large buffers


# mallopt parameters (malloc.h) and glibc's largest mmap threshold on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
_TRIM_THRESHOLD = 1024 * 1024 * 1024


def reuse_large_buffers() -> bool:
    """Tell glibc's malloc to serve allocations up to 32 MiB from the heap and keep up to 1 GiB of freed memory.

    Returns False (and changes nothing) where the C library is not glibc (macOS, musl) or refuses the settings.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    except (OSError, AttributeError, TypeError):  # no mallopt (macOS), no dlopen(NULL) (Windows)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1 and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    if not ok:
        logger.debug("mallopt refused the buffer-reuse settings; loading continues with the defaults")
    return ok


# ----------------------------------------------------------------------------------------------------
# bounds from the machine

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


def memory_bytes(*, free: bool = False) -> int | None:
    """Bytes of memory this process may use, the least of what bounds it: the machine's RAM, the cgroup's limit and
    the address space (``ulimit -v``); with ``free``, what is left of each now (the kernel's MemAvailable, the limit
    less the cgroup's use, less what this process maps already). None where none of them can be read."""
    try:
        machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system
        machine = None
    address_space = resource.getrlimit(resource.RLIMIT_AS)[0]
    bounds = [  # (a bound, how much of it is in use)
        (_number("/proc/meminfo", "MemAvailable") if free else machine, 0),
        (_number("/sys/fs/cgroup/memory.max"), _number("/sys/fs/cgroup/memory.current") if free else 0),
        (
            None if address_space == resource.RLIM_INFINITY else address_space,
            _number("/proc/self/status", "VmSize") if free else 0,
        ),
    ]
    return min((bound - used for bound, used in bounds if bound is not None and used is not None), default=None)


def _number(path: str, field: str | None = None) -> int | None:
    """The number file ``path`` holds (a cgroup's ``memory.max``: None for ``max``), or bytes of its line ``field:
    N kB`` (/proc's); None where it cannot be read."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    found = re.search(rf"^{field}:\s*(\d+) kB" if field else r"^(\d+)$", text.strip(), re.MULTILINE)
    return None if found is None else int(found.group(1)) * (1024 if field else 1)


def check_model_fits(args: UNetArgs) -> None:
    """Refuse a UNet whose fp32 weights alone exceed this machine's memory (it is built in RAM before anything else;
    training needs about four times that: weights, gradients and two optimizer moments)."""
    from unet import UNet  # the model package imports torch's nn stack: only needed when counting

    with torch.device("meta"):  # counted on the meta device: nothing is allocated
        unet = UNet(args.n_channels, args.n_classes, args.bilinear, args.base_channels)
    count = sum(tensor.numel() for tensor in [*unet.parameters(), *unet.buffers()])
    needed, memory = count * BYTES_PER_WEIGHT, memory_bytes()
    if memory is not None and needed > memory:
        raise ConfigError(
            f"--base-channels {args.base_channels} makes a UNet of {count:.3g} weights, {_gib(needed)} in fp32 (about "
            f"{_gib(4 * needed)} to train), more than this machine's {_gib(memory)} of memory; use a smaller "
            f"--base-channels (64 is the classic model, {_gib(4 * 31_000_000 * BYTES_PER_WEIGHT)} to train)"
        )


def _gib(size: int) -> str:
    return f"{size / 2**30:,.1f} GiB"


# ----------------------------------------------------------------------------------------------------
# shared memory for loader workers

SHARED_MEMORY_FOLDER = Path("/dev/shm")
PREFETCH_FACTOR = 2
"""DataLoader's default: batches each worker loads ahead."""
SAFETY_FACTOR = 2
"""Room for the batches the main process still holds (the one in use, those waiting for partners of their size)."""
LOADER_TIMEOUT_S = 300.0
"""How long the main process waits for one batch from its workers before giving up. Decoding one batch takes
seconds even for large photos; five minutes is only reached when a batch was lost."""
# How a worker's failure to share a batch reads (torch's messages); compared in lower case.
FAILURE_MARKERS = ("shared memory", "no space left on device", "bus error")

_MB = 1024 * 1024


def item_bytes(item: Any) -> int:
    """Bytes of ``item`` as a worker hands it over: pickled, which copies every tensor's data (a view's whole storage,
    as the worker's shared memory holds it) and the rest (names, paths) besides."""
    return len(pickle.dumps(item))


def shortage_message(workers_fix: str, detail: str) -> str:
    return (
        f"the loader workers cannot share batches with the main process: {detail}; use {workers_fix} (load in the "
        f"main process), or give the machine a larger {SHARED_MEMORY_FOLDER} (docker run --shm-size=2g; Kubernetes: "
        "an emptyDir volume with medium Memory mounted there)"
    )


def guarded_loader(
    dataset: Dataset, *, batch_size: int, workers: int, workers_fix: str, processes: int = 1, **options: Any
) -> SharedMemoryGuard:
    """The loader of train.py, predict.py and evaluate.py (``options``: DataLoader's others).

    ``workers`` processes start only once one item (``dataset[0]``) shows that their batches fit in
    ``SHARED_MEMORY_FOLDER`` beside those of the ``processes`` of this machine: each worker loads ``PREFETCH_FACTOR``
    batches ahead, with ``SAFETY_FACTOR`` for what the main process holds (where there is no such folder, not on
    Linux, nothing is checked). A batch they lose is an error after ``LOADER_TIMEOUT_S``, not a hang; that error and a
    worker's own shared-memory error become one line (``SharedMemoryGuard``). ``workers_fix``: the script's flag that
    turns workers off.
    """
    try:
        free = shutil.disk_usage(SHARED_MEMORY_FOLDER).free
    except OSError:  # no such folder (not Linux): nothing to check
        free = None
    if workers and len(dataset) and free is not None:  # type: ignore[arg-type]
        needed = item_bytes(dataset[0]) * batch_size * workers * PREFETCH_FACTOR * SAFETY_FACTOR * processes
        if needed > free:
            who = f"{workers} worker(s)" + (f" in each of {processes} processes" if processes > 1 else "")
            detail = (
                f"{who} need about {needed / _MB:.0f} MB of {SHARED_MEMORY_FOLDER} for batches of {batch_size} and "
                f"{free / _MB:.0f} MB are free"
            )
            raise ConfigError(shortage_message(workers_fix, detail))
    timeout = LOADER_TIMEOUT_S if workers else 0.0
    return SharedMemoryGuard(
        dataset, workers_fix, batch_size=batch_size, num_workers=workers, timeout=timeout, **options
    )


def _shared_memory_cause(error: RuntimeError) -> str | None:
    """Why a loader's error is a worker's failure to share a batch, or the timeout of a lost one; None: it is not."""
    message = str(error).lower()
    if "dataloader timed out" in message:
        # A worker that cannot allocate shared memory for its batch only prints a traceback: the batch never comes.
        return f"no batch arrived for {LOADER_TIMEOUT_S:.0f} s (a worker lost it: see any traceback above)"
    # A worker's error re-raised here carries its traceback: its own message says why (utils.errors).
    return user_message(error) if any(marker in message for marker in FAILURE_MARKERS) else None


class SharedMemoryGuard(DataLoader):
    """A DataLoader whose shared-memory failures and timeout are one ``ConfigError`` naming ``workers_fix``."""

    def __init__(self, dataset: Dataset, workers_fix: str, **options: Any) -> None:
        super().__init__(dataset, **options)
        self.workers_fix = workers_fix

    def __iter__(self) -> Generator[Any, None, None]:  # type: ignore[override]
        iterator = super().__iter__()
        try:
            yield from iterator
            return
        except Exception as error:
            if self.num_workers:
                # A worker's error re-raised by torch carries a traceback through the iterator (torch's frames: the
                # worker's own traceback is in the message). Whoever holds the error would keep the workers up, and
                # an iterator left to the cyclic garbage collector waits 5 s per worker to shut them down (its queues
                # are finalised first). Dropped, with this frame's reference, the workers shut down now.
                error.__traceback__ = None
            cause = _shared_memory_cause(error) if isinstance(error, RuntimeError) else None
            if cause is None:
                del iterator
                raise
        del iterator
        raise ConfigError(shortage_message(self.workers_fix, cause))
