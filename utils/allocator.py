"""Large buffers served from the heap and reused, instead of fresh pages from the kernel for every item.

glibc's ``malloc`` maps each allocation above its mmap threshold (128 KiB, growing to at most 32 MiB as buffers are
freed) straight from the kernel and unmaps it when freed, so a loader worker that makes the same few megabyte-sized
tensors for every item (the float image, the colour-mapped copy, the int64 mask) pays page faults for all of their
pages every time. On the 2-core VM of docs/PERFORMANCE.md that was more than half of a cached, augmented 959x640 item
(15 ms against 6.3 ms with the buffers reused). Raising the thresholds keeps freed memory in the heap for the next
item; the process's memory then stays at its peak, which is what a loader worker's is anyway. A training process
makes the same activations at every step: ``train.py`` asks for the same at start-up (bf16 compute-only 2.9 -> 3.7
images/s on that machine, docs/PERFORMANCE.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h) and glibc's largest mmap threshold on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
_TRIM_THRESHOLD = 1024 * 1024 * 1024


def reuse_large_buffers() -> bool:
    """Tell glibc's malloc to serve allocations up to 32 MiB from the heap and keep up to 1 GiB of freed memory.

    Returns False (and changes nothing) where the C library is not glibc (macOS, musl) or refuses the settings.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1 and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    if not ok:
        logger.debug("mallopt refused the buffer-reuse settings; loading continues with the defaults")
    return ok
