"""Counting a model's FLOPs and measuring the machine's matrix-product peak, for "achieved FLOP/s vs peak" figures.

FLOPs are counted with ``torch.utils.flop_counter.FlopCounterMode`` on the ``meta`` device: the counter sees every
matrix product and convolution of the forward and backward passes, but no arithmetic runs, so counting a base-64 UNet
costs seconds even on a CPU that needs minutes per training step. The counter counts a fused multiply-add as two
FLOPs and ignores element-wise work (BatchNorm, ReLU, the loss), which is the convention of the peak it is compared
with: the peak is what a large square matrix product of the same dtype reaches on this device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from scripts.bench.timing import sync
from utils.hardware import compute_dtype


def matmul_flops(n: int) -> int:
    """FLOPs of one ``n x n`` by ``n x n`` matrix product (a multiply and an add per term)."""
    return 2 * n**3


def count_flops(run: Callable[[], object]) -> int:
    """FLOPs of the matrix products and convolutions that ``run()`` dispatches."""
    counter = FlopCounterMode(display=False)
    with counter:
        run()
    return int(counter.get_total_flops())


def training_flops_per_image(
    build_model: Callable[[], nn.Module],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    *,
    channels: int,
    height: int,
    width: int,
    batch_size: int = 1,
) -> int:
    """Forward + backward FLOPs per image of the model ``build_model()`` makes, counted on the meta device.

    ``loss_fn(logits, masks)`` closes the graph so that the backward pass is counted exactly as training runs it
    (gradients for the weights and for every activation but the input's).
    """
    with torch.device("meta"):
        model = build_model()
        images = torch.empty(batch_size, channels, height, width)
        masks = torch.zeros(batch_size, height, width, dtype=torch.long)
    model.train()

    def step() -> None:
        loss_fn(model(images), masks).backward()

    return count_flops(step) // batch_size


def inference_flops_per_image(build_model: Callable[[], nn.Module], *, channels: int, height: int, width: int) -> int:
    """Forward FLOPs per image in evaluation mode (validation, prediction), counted on the meta device."""
    with torch.device("meta"):
        model = build_model()
        images = torch.empty(1, channels, height, width)
    model.eval()
    with torch.no_grad():
        return count_flops(lambda: model(images))


@dataclass(frozen=True)
class MatmulPeak:
    """The best FLOP/s a square matrix product of ``dtype`` reached, and at which size."""

    dtype: str
    flops_per_s: float
    size: int
    seconds_per_product: float


def measure_matmul_peak(
    dtype: str,
    device: torch.device,
    *,
    max_size: int | None = None,
    min_seconds: float = 0.2,
    max_seconds_per_product: float = 1.0,
) -> MatmulPeak:
    """Time square matrix products of growing size (256, 512, ...) and return the fastest rate seen.

    Sizes double while the next one is predicted to take under ``max_seconds_per_product``, so a dtype the hardware
    only emulates (bf16 on a CPU without AVX-512 BF16 or AMX, hundreds of times slower) still finishes in seconds.
    Each size repeats its product for at least ``min_seconds`` after one untimed warm-up product.
    """
    torch_dtype = compute_dtype(dtype)
    max_size = max_size or (8192 if device.type == "cuda" else 2048)
    best: MatmulPeak | None = None
    size = 256
    while size <= max_size:
        generator = torch.Generator(device="cpu").manual_seed(size)
        a = torch.randn(size, size, generator=generator).to(device=device, dtype=torch_dtype)
        b = torch.randn(size, size, generator=generator).to(device=device, dtype=torch_dtype)
        seconds = _time_product(a, b, device, min_seconds)
        rate = matmul_flops(size) / seconds
        if best is None or rate > best.flops_per_s:
            best = MatmulPeak(dtype, rate, size, seconds)
        # Doubling the side multiplies the work by eight; stop before a product that would take too long.
        if seconds * 8 > max_seconds_per_product:
            break
        size *= 2
    assert best is not None
    return best


def _time_product(a: Tensor, b: Tensor, device: torch.device, min_seconds: float) -> float:
    """Mean seconds of one ``a @ b``, repeated for at least ``min_seconds`` after a warm-up product."""
    sync(device)
    started = time.perf_counter()
    torch.mm(a, b)
    sync(device)
    first = time.perf_counter() - started
    # Batches of products between synchronisations, so that a GPU is never idle waiting for the host.
    per_batch = max(1, int(min_seconds / max(first, 1e-6) / 4))
    count, started = 0, time.perf_counter()
    while True:
        for _ in range(per_batch):
            torch.mm(a, b)
        count += per_batch
        sync(device)
        elapsed = time.perf_counter() - started
        if elapsed >= min_seconds:
            return elapsed / count
