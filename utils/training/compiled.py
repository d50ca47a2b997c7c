"""``--compile``: the model's blocks compiled one by one, with the compiled code kept in the run folder.

Compiled per block, as torchtitan does, rather than as one graph: each block (a UNet stage, the ResNet encoder, a
decoder block, the heads) becomes its own graph, so a block's norms and activations fuse while the graphs stay small
to compile. The compiled blocks live in a shallow copy of the model that shares its parameters and buffers: the plain
model stays eager for validation, the EMA copy and checkpoints (whose keys carry no ``_orig_mod.``), and nothing
compiles for the validation images' shapes. Shapes are static (``dynamic=False``): blocks of one class share their
``forward``, so dynamo's automatic dynamic shapes would otherwise make the channel and spatial sizes symbolic after the
second block. A batch of another size (the epoch's last) compiles once more in the first epoch; from then on no shape
compiles again.

The compiled code is kept in the run folder (``RunFolder.compile_cache``): inductor's on-disk caches (its FX graph and
AOTAutograd caches, on by default) are pointed there before anything compiles, so a resumed or requeued run of the
same folder loads the compiled graphs instead of compiling them again.
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

CACHE_ENVIRONMENT = "TORCHINDUCTOR_CACHE_DIR"
# What the paired benchmark measured for the compiled step against the eager one, per device kind (steady state,
# docs/PERFORMANCE.md); a device kind whose ratio is below 1 warns at the start of a --compile run.
MEASURED_SPEEDUP: dict[str, tuple[float, str]] = {
    "cpu-fp32": (0.96, "train.py, UNet base 32, 240x160, batch 4, 2 threads, 2 cores with native bf16, quiet"),
    "cpu-bf16": (0.80, "train.py, UNet base 32, 240x160, batch 4, 2 threads, 2 cores with native bf16, quiet"),
}


def compile_blocks(model: nn.Module) -> nn.Module:
    """A module whose forward is ``model``'s with each child block compiled; it shares ``model``'s tensors.

    A child ``ModuleList`` (the ResNet decoder) has each of its blocks compiled.
    """
    from torch._dynamo.eval_frame import OptimizedModule  # here: importing dynamo costs seconds at every start

    compiled = copy.copy(model)  # the same forward, parameters and buffers; its own child-module table
    compiled._modules = {name: _compiled(child) for name, child in model._modules.items()}
    blocks = sum(1 for module in compiled.modules() if isinstance(module, OptimizedModule))
    # Every block of a class is an entry on its forward's code, once per batch size: room for two sizes and more.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * blocks)
    return compiled


def _compiled(child: nn.Module | None) -> nn.Module | None:
    if child is None or not any(True for _ in child.parameters()):
        return child
    if isinstance(child, nn.ModuleList):
        return nn.ModuleList(torch.compile(block, dynamic=False) for block in child)
    return torch.compile(child, dynamic=False)


def use_compile_cache(folder: Path) -> None:
    """Keep this process's compiled code in ``folder`` (created): call before the first compile."""
    folder.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_ENVIRONMENT] = str(folder)
    warm = any(folder.iterdir())
    logger.info("Compiled code cached in %s (%s)", folder, "reused" if warm else "empty: the first steps compile")


def warn_if_slower(device: torch.device, precision: str) -> None:
    """Say at the start of a --compile run when the benchmark measured compiled slower than eager on this device."""
    measured = MEASURED_SPEEDUP.get(f"{device.type}-{precision}")
    if measured is not None and measured[0] < 1:
        speedup, where = measured
        logger.warning(
            f"--compile: on {device.type} the compiled step measured {speedup:.2f}x the eager one's images/s ({where}; "
            "docs/PERFORMANCE.md); drop --compile to train faster"
        )
