"""Will a whole-image forward pass fit in memory? The estimate, the memory free on the device, and a window size.

A UNet's activations grow with the image's area: measured on the CPU (peak resident memory during one forward pass
under ``torch.inference_mode``), about 9-12 float32 values per pixel per base channel (``ACTIVATION_FLOATS``), plus
the input and the logits. Before a whole image runs, ``MemoryPlanner.tile_if_needed`` compares that estimate with
the memory free on the device: on CUDA ``torch.cuda.mem_get_info``; on the CPU the smallest of the kernel's
``MemAvailable``, the cgroup's limit and the address-space limit (``ulimit -v``). When it would not fit, prediction
switches to windows of the largest size that fits, with one warning.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from utils.errors import UserError
from utils.hardware import cgroup_memory
from utils.inference.tiling import DOWNSAMPLING, MIN_TILE, TileSettings

logger = logging.getLogger(__name__)

# float32 activation values alive at the peak of a forward pass, per input pixel and per base channel (measured).
ACTIVATION_FLOATS = 12
BYTES_PER_FLOAT = 4
# Leave this share of the free memory to everything else (allocator slack, decoding, writers).
USABLE_FRACTION = 0.5
GIB = 1024**3


def estimate_forward_bytes(model: nn.Module, batch: int, height: int, width: int, tta: bool = False) -> int:
    """Peak bytes of one forward pass of ``batch`` images of ``height`` x ``width`` network pixels."""
    base_channels = int(getattr(model, "base_channels", 64))
    in_channels, n_classes = int(getattr(model, "n_channels", 3)), int(getattr(model, "n_classes", 2))
    per_pixel = ACTIVATION_FLOATS * base_channels + in_channels + n_classes * (3 if tta else 1)
    return batch * height * width * per_pixel * BYTES_PER_FLOAT


def free_bytes(device: torch.device) -> int | None:
    """Memory a forward pass may still use on ``device``; None where it cannot be told (MPS, other systems)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    limits = [_proc_kib("/proc/meminfo", "MemAvailable:"), _cgroup_free(), _address_space_free()]
    known = [limit for limit in limits if limit is not None]
    return min(known) if known else None


def _proc_kib(path: str, field_name: str) -> int | None:
    """Bytes of a ``field_name ... kB`` line of a /proc file; None where it cannot be read."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field_name):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_free() -> int | None:
    limit, used = cgroup_memory("max"), cgroup_memory("current")
    return None if limit is None or used is None else limit - used


def _address_space_free() -> int | None:
    """``ulimit -v`` minus the address space this process already maps (libraries count too)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    mapped = _proc_kib("/proc/self/status", "VmSize:")
    return None if mapped is None else soft - mapped


@dataclass
class MemoryPlanner:
    """Decides, per batch shape, whether a whole-image pass fits in ``budget_bytes`` or which windows to use."""

    budget_bytes: int | None = None
    """Bytes a forward pass may use; None: read the device's free memory at each decision."""
    device: torch.device | None = None
    """Where the free memory is read when ``budget_bytes`` is None; None as well: unknown, never tile on our own."""
    _warned: bool = field(default=False, init=False)

    def budget(self) -> int | None:
        """Bytes the next forward pass may use (read now: decoding and earlier batches change it)."""
        if self.budget_bytes is not None or self.device is None:
            return self.budget_bytes
        free = free_bytes(self.device)
        return None if free is None else int(free * USABLE_FRACTION)

    def tile_if_needed(
        self,
        model: nn.Module,
        batch: int,
        image_shape: tuple[int, ...],
        tta: bool = False,
        window_batch: int | None = None,
    ) -> TileSettings | None:
        """None when ``batch`` whole images of ``image_shape`` ``[C, h, w]`` fit, else windows that do.

        ``window_batch`` is how many windows run at once (default ``batch``).
        """
        _, height, width = image_shape
        needed = estimate_forward_bytes(model, batch, height, width, tta)
        budget = self.budget()
        if budget is None or needed <= budget:
            return None
        # The tiled pass keeps the blended logits (and weights) of the whole batch besides one batch of windows.
        n_classes = int(getattr(model, "n_classes", 2))
        stitched = batch * height * width * (n_classes + 1) * BYTES_PER_FLOAT
        tile = self._largest_tile(model, window_batch or batch, budget - stitched, tta)
        if tile is None:
            raise UserError(
                f"a {width}x{height} image needs about {needed / GIB:.1f} GiB to predict but only "
                f"{budget / GIB:.1f} GiB are free, too little even for --tile {MIN_TILE}; "
                "lower --scale or --batch-size, or free memory"
            )
        log = logger.warning if not self._warned else logger.debug
        log(
            "a whole %dx%d image needs about %.1f GiB but %.1f GiB are free; predicting in %d-pixel windows "
            "(pass --tile %d to choose this yourself)",
            width,
            height,
            needed / GIB,
            budget / GIB,
            tile,
            tile,
        )
        self._warned = True
        return TileSettings(tile, tta=tta)

    @staticmethod
    def _largest_tile(model: nn.Module, batch: int, budget: int, tta: bool) -> int | None:
        # Windows run `batch` at a time and the last row/column may run up to 15 pixels longer.
        tile = None
        size = MIN_TILE
        while estimate_forward_bytes(model, batch, size + DOWNSAMPLING, size + DOWNSAMPLING, tta) <= budget:
            tile = size
            size += DOWNSAMPLING
            if size > 1 << 16:
                break
        return tile
