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
import math
import re
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


def _bytes_per_pixel(model: nn.Module, tta: bool) -> int:
    """Peak bytes of a forward pass per network-input pixel of one image."""
    base_channels = int(getattr(model, "base_channels", 64))
    in_channels, n_classes = int(getattr(model, "n_channels", 3)), int(getattr(model, "n_classes", 2))
    return (ACTIVATION_FLOATS * base_channels + in_channels + n_classes * (3 if tta else 1)) * BYTES_PER_FLOAT


def estimate_forward_bytes(model: nn.Module, batch: int, height: int, width: int, tta: bool = False) -> int:
    """Peak bytes of one forward pass of ``batch`` images of ``height`` x ``width`` network pixels."""
    return batch * height * width * _bytes_per_pixel(model, tta)


def free_bytes(device: torch.device) -> int | None:
    """Memory a forward pass may still use on ``device``; None where it cannot be told (MPS, other systems)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    cgroup_limit, cgroup_used = cgroup_memory("max"), cgroup_memory("current")
    # ``ulimit -v`` counts the address space this process already maps (libraries too).
    address_space, _ = resource.getrlimit(resource.RLIMIT_AS)
    mapped = _proc_kib("/proc/self/status", "VmSize")
    limits = [
        _proc_kib("/proc/meminfo", "MemAvailable"),
        None if cgroup_limit is None or cgroup_used is None else cgroup_limit - cgroup_used,
        None if address_space == resource.RLIM_INFINITY or mapped is None else address_space - mapped,
    ]
    return min((limit for limit in limits if limit is not None), default=None)


def _proc_kib(path: str, field_name: str) -> int | None:
    """Bytes of a ``<field_name>: ... kB`` line of a /proc file; None where it cannot be read."""
    try:
        found = re.search(rf"^{field_name}:\s*(\d+)", Path(path).read_text(), re.MULTILINE)
    except OSError:
        return None
    return None if found is None else int(found.group(1)) * 1024


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
        # The tiled pass keeps the blended logits (and weights) of the whole batch besides one batch of windows,
        # which run ``window_batch`` at a time; the last row/column may run up to 15 pixels longer: the largest
        # window whose side plus 16 fits what is left.
        n_classes = int(getattr(model, "n_classes", 2))
        stitched = batch * height * width * (n_classes + 1) * BYTES_PER_FLOAT
        window_pixel_bytes = (window_batch or batch) * _bytes_per_pixel(model, tta)
        side = math.isqrt(max(0, budget - stitched) // window_pixel_bytes)
        tile = (side - DOWNSAMPLING) // DOWNSAMPLING * DOWNSAMPLING
        if tile < MIN_TILE:
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
