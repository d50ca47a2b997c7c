"""--ema DECAY: an exponential moving average of the weights, the model that validates and that inference uses.

After every optimizer step that was really applied, ``average = decay * average + (1 - decay) * weights`` for every
parameter, and the buffers (BatchNorm statistics) are copied. A step skipped for non-finite gradients
(``utils.training.step``, or GradScaler under fp16) moves no weights and so must not move the average either;
it is recognised on the device, without a host synchronisation, by the optimizer's own step count, which a skipped
step leaves unchanged (the fused AdamW takes the skip as ``found_inf``; the other optimizers are not stepped at all).

Every rank holds the same weights after each step (DDP all-reduces the gradients, so every rank applies the same
update) and skips the same steps, so every rank computes the same average with no communication.

A small own class rather than ``torch.optim.swa_utils.AveragedModel``: its state is exactly a model ``state_dict``
(the averaged module's, no ``module.`` prefixes and no ``n_averaged`` counter), which is what a checkpoint's
``model_state`` holds and what inference rebuilds, and a resumed run restores it with ``load_state_dict`` and
continues bit-identically: the decay is a constant, and the only other state (the step count last seen) is the
optimizer's, restored with it.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class WeightAverage:
    """The exponential moving average of ``model``'s weights, held as a module of the same architecture."""

    def __init__(self, model: nn.Module, decay: float, optimizer: torch.optim.Optimizer) -> None:
        """Starts from ``model``'s current weights; ``optimizer`` steps ``model`` (its state already restored when
        resuming: its step count is the reference that tells an applied step from a skipped one). ``decay`` in
        (0, 1): checked where --ema is parsed."""
        self.decay = decay
        self.module = copy.deepcopy(model).eval()
        self.module.requires_grad_(False)
        self._optimizer = optimizer
        self._parameters = list(model.parameters())
        self._averaged = list(self.module.parameters())
        self._buffers = list(model.buffers())
        self._averaged_buffers = list(self.module.buffers())
        self._steps_seen = self._step_count()

    def update(self) -> None:
        """Average in ``model``'s weights if the optimizer step just taken was applied; call after each step."""
        steps = self._step_count()
        applied = steps != self._steps_seen.to(steps.device, non_blocking=True)
        self._steps_seen = steps
        # lerp by 0 leaves the average as it is: a skipped step is decided on the device, not read on the host.
        weight = torch.where(applied, 1.0 - self.decay, 0.0).to(self._averaged[0].device, torch.float32)
        with torch.no_grad():
            torch._foreach_lerp_(self._averaged, [p.detach() for p in self._parameters], weight)
            if self._buffers:
                torch._foreach_copy_(self._averaged_buffers, self._buffers)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged weights, as the model's own ``state_dict`` (loadable into the architecture as it is)."""
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Continue from ``state``; after the optimizer's own restore, whose step count is the reference again."""
        self.module.load_state_dict(state)
        self._steps_seen = self._step_count()

    def _step_count(self) -> torch.Tensor:
        """The optimizer's step count as a tensor (0 before its first applied step); no host synchronisation.

        Read from the last parameter with optimizer state: the output layer, which is always trained (an encoder
        frozen by --freeze-encoder-epochs has no state, or a shorter count, until it is released).
        """
        for parameter in reversed(self._parameters):
            state = self._optimizer.state.get(parameter)
            if state and "step" in state:
                return torch.as_tensor(state["step"]).detach().clone()
        return torch.zeros(())
