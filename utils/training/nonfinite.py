"""Optimizer steps whose gradients hold NaN or inf: skipped on the device, counted, and read at the loop's syncs.

One step with non-finite gradients (a learning rate far too large, an overflow) would poison the weights, and through
them every later checkpoint. So every optimizer step takes the global gradient norm (clipping computes it anyway) and
skips the step when the norm is not finite:

* the fused AdamW (the default) skips on the device: its ``found_inf`` input leaves the weights, the moments and the
  step count untouched, and nothing waits for the GPU;
* other optimizers (RMSprop) cannot, so the answer is read on the host: one synchronisation per step, the price that
  GradScaler pays for the same check;
* the BatchNorm running statistics, which the forward pass of the skipped step already updated, are put back.

The gradients are all-reduced before the norm is taken, so every rank skips the same steps without talking to the
others. The counts stay on the device until the training loop synchronises anyway (logging, checkpoints). fp16 runs
leave all this to GradScaler, whose skipped steps are a normal part of finding the loss scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class SkipReport:
    """Skipped optimizer steps since the previous report."""

    skipped: int
    """Steps skipped since the previous report."""
    longest_run: int
    """Longest run of consecutive skipped steps since the previous report (a run may have started before it)."""
    current_run: int
    """Consecutive skipped steps up to now (0 when the latest step was applied)."""


class NonFiniteStepGuard:
    """Steps an optimizer unless the gradients are non-finite, and counts the steps it skipped."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self._optimizer = optimizer
        self._parameters = [p for p in model.parameters() if p.requires_grad]
        # BatchNorm running means and variances, saved and restored as one flat tensor per dtype and device: a few
        # kernels per step instead of one per tensor.
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for buffer in model.buffers():
            if buffer.is_floating_point():
                groups.setdefault((buffer.dtype, buffer.device), []).append(buffer)
        self._statistics = [(buffers, _flatten(buffers)) for buffers in groups.values()]
        # The fused kernels take the skip decision as a tensor; the others need it on the host.
        self._skips_on_device = bool(optimizer.defaults.get("fused"))
        zero = torch.zeros((), dtype=torch.int64, device=device)
        self._current_run, self._longest_run, self._skipped = zero, zero.clone(), zero.clone()

    def start_step(self) -> None:
        """Remember the BatchNorm statistics; call before the first forward pass of each optimizer step."""
        for buffers, saved in self._statistics:
            saved.copy_(_flatten(buffers))

    def step(self, grad_clip: float) -> None:
        """Clip the gradients to ``grad_clip`` (0 = no clipping), then step unless their norm is NaN or inf."""
        if grad_clip:
            norm = nn.utils.clip_grad_norm_(self._parameters, grad_clip)
        else:
            norm = nn.utils.get_total_norm([p.grad for p in self._parameters if p.grad is not None])
        finite = torch.isfinite(norm)
        if self._skips_on_device:
            # The attribute GradScaler sets for the same purpose: 1.0 makes the fused step a no-op.
            self._optimizer.found_inf = (~finite).to(torch.float32)
            try:
                self._optimizer.step()
            finally:
                del self._optimizer.found_inf
        elif finite.item():
            self._optimizer.step()
        for buffers, saved in self._statistics:
            kept = torch.where(finite, _flatten(buffers), saved).split([b.numel() for b in buffers])
            torch._foreach_copy_(buffers, [part.view_as(b) for part, b in zip(kept, buffers, strict=True)])
        self._current_run = torch.where(finite, 0, self._current_run + 1)
        torch.maximum(self._longest_run, self._current_run, out=self._longest_run)
        self._skipped += ~finite

    def report(self) -> SkipReport:
        """Skipped steps since the previous report (reads the device: call where the loop synchronises anyway)."""
        skipped, longest_run, current_run = torch.stack([self._skipped, self._longest_run, self._current_run]).tolist()
        self._skipped.zero_()
        self._longest_run.copy_(self._current_run)
        return SkipReport(skipped=skipped, longest_run=longest_run, current_run=current_run)


def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])
