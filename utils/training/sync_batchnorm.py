"""``--sync-bn``: BatchNorm statistics over the global batch, on every device.

On CUDA this is ``torch.nn.SyncBatchNorm``. PyTorch's SyncBatchNorm refuses CPU tensors, so for CPU (gloo) runs the
BatchNorm layers become ``CpuSyncBatchNorm``: the same maths written with differentiable all-reduces. It is a
``BatchNorm2d`` subclass with the same parameters and buffers, so checkpoints are identical either way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn


class CpuSyncBatchNorm(nn.BatchNorm2d):
    """BatchNorm2d whose training-mode statistics are the mean and variance over all ranks' batches.

    The all-reduces are autograd-aware (their backward all-reduces the gradients), so the gradient equals that of
    BatchNorm over the concatenated global batch. Evaluation mode uses the running statistics and communicates nothing.
    """

    def forward(self, input: Tensor) -> Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(input)
        self._check_input_dim(input)
        dims = (0, 2, 3)
        # Statistics in float32 even under bf16 autocast, as BatchNorm's own kernels do.
        values = input.float()
        count = torch.tensor([values.numel() // values.shape[1]], dtype=values.dtype, device=values.device)
        # Two passes (mean, then squared deviations) avoid the cancellation of E[x^2] - E[x]^2.
        totals = _AllReduceSum.apply(torch.cat([values.sum(dim=dims), count]))
        global_count = totals[-1]
        mean = totals[:-1] / global_count
        centered = values - mean.view(1, -1, 1, 1)
        var = _AllReduceSum.apply(centered.square().sum(dim=dims)) / global_count
        output = centered * torch.rsqrt(var + self.eps).view(1, -1, 1, 1)
        if self.affine:
            output = output * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), global_count.item())
        return output.to(input.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: Tensor, biased_var: Tensor, count: float) -> None:
        self.num_batches_tracked.add_(1)
        momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        # Like BatchNorm: the running variance is the unbiased estimate over the (global) batch.
        unbiased = biased_var * (count / max(count - 1.0, 1.0))
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), momentum)


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks; the gradient of every rank's input is the sum over ranks of the output gradients."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, tensor: Tensor) -> Tensor:
        total = tensor.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_output: Tensor) -> Tensor:
        total = grad_output.contiguous().clone()
        dist.all_reduce(total)
        return total


def convert_sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """Replace the BatchNorm2d layers of ``model`` by a synchronised version suited to ``device``."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return _replace_batchnorm(model)


def _replace_batchnorm(module: nn.Module) -> nn.Module:
    if type(module) is nn.BatchNorm2d:
        replacement = CpuSyncBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        replacement.load_state_dict(module.state_dict())
        replacement.train(module.training)
        return replacement
    for name, child in module.named_children():
        module.add_module(name, _replace_batchnorm(child))
    return module
