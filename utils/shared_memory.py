"""Room in ``/dev/shm`` for loader workers, checked before they start, and their shared-memory failures as one line.

A ``DataLoader`` worker hands each batch to the main process through POSIX shared memory (files in ``/dev/shm`` on
Linux). Docker gives a container 64 MB there by default: a worker that cannot allocate prints a traceback from its
queue's feeder thread and the batch never arrives, so the main process waits for ever. So train.py, predict.py and
evaluate.py

- estimate what their workers keep in flight (``needed_bytes``) from one real item and refuse to start them when
  ``/dev/shm`` has less free (``check_room``), with one ``Error:`` line naming the workers flag and the larger
  ``/dev/shm`` that fix it;
- give the loader a ``LOADER_TIMEOUT_S`` (a batch that never comes becomes an error, not a hang) and turn that
  error, and a worker's own shared-memory error, into the same line (``SharedMemoryGuard``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from utils.errors import ConfigError

SHARED_MEMORY_FOLDER = Path("/dev/shm")
PREFETCH_FACTOR = 2
"""DataLoader's default: batches each worker loads ahead."""
SAFETY_FACTOR = 2
"""Room for the batches the main process still holds (the one in use, those waiting for partners of their size)."""
LOADER_TIMEOUT_S = 300.0
"""How long the main process waits for one batch from its workers before giving up. Decoding one batch takes
seconds even for large photos; five minutes is only reached when a batch was lost."""
# How a worker's failure to share a batch reads (torch's messages), and the loader's timeout; compared in lower case.
FAILURE_MARKERS = ("shared memory", "no space left on device", "bus error", "dataloader timed out")

_MB = 1024 * 1024


def tensor_bytes(item: Any) -> int:
    """Bytes of the tensors in ``item`` (a tensor, or dicts, lists, tuples and dataclasses of them)."""
    if isinstance(item, torch.Tensor):
        return item.numel() * item.element_size()
    if isinstance(item, dict):
        return sum(tensor_bytes(value) for value in item.values())
    if isinstance(item, list | tuple):
        return sum(tensor_bytes(value) for value in item)
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return sum(tensor_bytes(getattr(item, field.name)) for field in dataclasses.fields(item))
    return 0


def needed_bytes(item_bytes: int, batch_size: int, workers: int, processes: int = 1) -> int:
    """Shared memory the loaders of ``processes`` processes (the ranks of one machine) keep in flight: each of their
    ``workers`` loads ``PREFETCH_FACTOR`` batches ahead, with ``SAFETY_FACTOR`` for what the main process holds."""
    return item_bytes * batch_size * workers * PREFETCH_FACTOR * SAFETY_FACTOR * processes


def free_bytes(folder: Path = SHARED_MEMORY_FOLDER) -> int | None:
    """Bytes free in ``folder``, or None where there is no such folder (not Linux): nothing to check there."""
    try:
        stats = os.statvfs(folder)
    except (OSError, AttributeError):  # no folder; no statvfs (Windows)
        return None
    return stats.f_bavail * stats.f_frsize


def shortage_message(workers_fix: str, detail: str) -> str:
    return (
        f"the loader workers cannot share batches with the main process: {detail}; use {workers_fix} (load in the "
        f"main process), or give the machine a larger {SHARED_MEMORY_FOLDER} (docker run --shm-size=2g; Kubernetes: "
        "an emptyDir volume with medium Memory mounted there)"
    )


def check_room(
    item: Any,
    *,
    batch_size: int,
    workers: int,
    workers_fix: str,
    processes: int = 1,
    folder: Path = SHARED_MEMORY_FOLDER,
) -> None:
    """Raise ``ConfigError`` when ``workers`` loader workers (per process) would not fit their batches of
    ``batch_size`` items like ``item`` into ``folder``. ``workers_fix``: the flag that turns workers off."""
    if workers <= 0:
        return
    free = free_bytes(folder)
    needed = needed_bytes(tensor_bytes(item), batch_size, workers, processes)
    if free is None or needed <= free:
        return
    who = f"{workers} worker(s)" + (f" in each of {processes} processes" if processes > 1 else "")
    raise ConfigError(
        shortage_message(
            workers_fix,
            f"{who} need about {needed / _MB:.0f} MB of {folder} for batches of {batch_size} and {free / _MB:.0f} MB "
            "are free",
        )
    )


def is_shared_memory_failure(error: BaseException) -> bool:
    """Whether a loader's ``RuntimeError`` is a worker's failure to share a batch, or the timeout of a lost one."""
    message = str(error).lower()
    return isinstance(error, RuntimeError) and any(marker in message for marker in FAILURE_MARKERS)


def loader_timeout(workers: int) -> float:
    """The ``timeout`` to give a ``DataLoader`` with ``workers`` workers (0: none, the main process loads)."""
    return LOADER_TIMEOUT_S if workers > 0 else 0.0


def _cause(error: RuntimeError) -> str:
    if "dataloader timed out" in str(error).lower():
        # A worker that cannot allocate shared memory for its batch only prints a traceback: the batch never comes.
        return f"no batch arrived for {LOADER_TIMEOUT_S:.0f} s (a worker lost it: see any traceback above)"
    # A worker's error ends with its own last line (after "Original Traceback"): that one says why.
    return (str(error).strip().splitlines() or ["?"])[-1].strip()


class SharedMemoryGuard:
    """Iterates a loader and turns a shared-memory failure or the loader's timeout into one ``ConfigError``."""

    def __init__(self, loader: Any, workers_fix: str) -> None:
        self.loader = loader
        self.workers_fix = workers_fix

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self.loader)
        while True:
            failure = None
            try:
                batch = next(iterator)
            except StopIteration:
                return
            except RuntimeError as error:
                if not is_shared_memory_failure(error):
                    raise
                failure = shortage_message(self.workers_fix, _cause(error))
                # A worker's error re-raised by torch sits in a reference cycle through its traceback, which holds
                # the iterator: dropped, the iterator can shut its workers down at once (see below).
                error.__traceback__ = None
            if failure is not None:
                # The raised error's traceback holds this frame: without its iterator, whose workers shut down now
                # (idle workers ignoring SIGTERM would otherwise keep the process from exiting).
                del iterator
                raise ConfigError(failure)
            yield batch

    def __getattr__(self, name: str) -> Any:
        # The loader's other attributes (sampler, dataset, batch_size) as the loader's users expect them.
        if name == "loader":  # not set yet (an unpickled copy): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)
