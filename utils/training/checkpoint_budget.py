"""How much disk a run's checkpoints take: one log line before training, so a full disk is foreseen, not met.

Full-state files (``last.pth``, ``INTERRUPTED.pth``, ``checkpoint_epoch{N}.pth``) hold the weights plus the
optimizer's per-parameter state (two tensors of the weights' size with AdamW); ``best.pth`` and ``best-K.pth`` hold
the weights only (``utils.training.run_folder``). Sizes are estimated from the tensors (the optimizer's state does not
exist before the first step); pickling adds a few kB.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointBudget:
    full_state_bytes: int
    weights_only_bytes: int
    full_state_files: int
    """At most this many full-state files at once: last.pth, INTERRUPTED.pth and the kept epoch files."""
    weights_only_files: int

    @property
    def total_bytes(self) -> int:
        return self.full_state_bytes * self.full_state_files + self.weights_only_bytes * self.weights_only_files


def optimizer_slots(optimizer: torch.optim.Optimizer) -> int:
    """Tensors of a parameter's size that ``optimizer`` keeps per parameter (Adam: exp_avg and exp_avg_sq)."""
    defaults = optimizer.defaults
    if isinstance(optimizer, torch.optim.RMSprop):
        return 1 + int(defaults.get("momentum", 0) > 0) + int(bool(defaults.get("centered")))
    if isinstance(optimizer, torch.optim.SGD):
        return int(defaults.get("momentum", 0) > 0)
    return 2  # Adam, AdamW and most adaptive optimizers


def epoch_files_written(*, epochs_done: int, last_epoch: int, save_every: int, keep_last: int) -> int:
    """checkpoint_epoch{N}.pth files this run writes (epochs ``epochs_done+1 .. last_epoch``), after --keep-last."""
    if not save_every:
        return 0
    written = sum(1 for number in range(epochs_done + 1, last_epoch + 1) if number % save_every == 0)
    return min(written, keep_last) if keep_last else written


def checkpoint_budget(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, epoch_files: int, keep_best: int
) -> CheckpointBudget:
    weights = sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values())
    parameters = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return CheckpointBudget(
        full_state_bytes=weights + parameters * optimizer_slots(optimizer),
        weights_only_bytes=weights,
        full_state_files=2 + epoch_files,
        weights_only_files=1 + keep_best,
    )


def log_budget(budget: CheckpointBudget) -> None:
    logger.info(
        "Checkpoints: a full-state file (last.pth, INTERRUPTED.pth, checkpoint_epoch{N}.pth) is about %s, best.pth "
        "(weights only) about %s; this run keeps at most %d full-state and %d weights-only files, about %s",
        _megabytes(budget.full_state_bytes),
        _megabytes(budget.weights_only_bytes),
        budget.full_state_files,
        budget.weights_only_files,
        _megabytes(budget.total_bytes),
    )


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB"
