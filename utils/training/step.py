"""One optimizer step: forward and backward over its micro-batches, the guarded optimizer update, and the average of
the weights it moves.

``TrainStep`` is the object the training loop runs and the one the benchmark times, so the benchmark's compute-only
figure measures exactly what ``train.py`` does per step (autocast, gradient accumulation without all-reduce on the
first micro-batches, the non-finite guard, clipping, the scheduler step, --ema). It does no host synchronisation: losses
and the count of skipped steps accumulate on the device until ``take_losses`` and ``skipped_steps`` read them.

Steps whose gradients hold NaN or inf are skipped (``NonFiniteStepGuard``). One such step (a learning rate far too
large, an overflow) would poison the weights, and through them every later checkpoint. So every optimizer step takes
the global gradient norm (clipping computes it anyway) and skips the step when the norm is not finite:

* the fused AdamW (the default) skips on the device: its ``found_inf`` input leaves the weights, the moments and the
  step count untouched, and nothing waits for the GPU;
* other optimizers (RMSprop) cannot, so the answer is read on the host: one synchronisation per step, the price that
  GradScaler pays for the same check;
* the BatchNorm running statistics, which the forward pass of the skipped step already updated, are put back.

The gradients are all-reduced before the norm is taken, so every rank skips the same steps without talking to the
others. The counts stay on the device until the training loop synchronises anyway (logging, checkpoints). fp16 runs
leave all this to GradScaler, whose skipped steps are a normal part of finding the loss scale.

``WeightAverage`` (--ema DECAY): an exponential moving average of the weights, the model that validates and that
inference uses.

After every optimizer step that was really applied, ``average = decay * average + (1 - decay) * weights`` for every
parameter, and the buffers (BatchNorm statistics) are copied. A step skipped for non-finite gradients (above, or
GradScaler under fp16) moves no weights and so must not move the average either; it is recognised on the device,
without a host synchronisation, by the optimizer's own step count, which a skipped step leaves unchanged (the fused
AdamW takes the skip as ``found_inf``; the other optimizers are not stepped at all).

Every rank holds the same weights after each step (DDP all-reduces the gradients, so every rank applies the same
update) and skips the same steps, so every rank computes the same average with no communication.

A small own class rather than ``torch.optim.swa_utils.AveragedModel``: its state is exactly a model ``state_dict``
(the averaged module's, no ``module.`` prefixes and no ``n_averaged`` counter), which is what a checkpoint's
``model_state`` holds and what inference rebuilds, and a resumed run restores it with ``load_state_dict`` and
continues bit-identically: the decay is a constant, and the only other state (the step count last seen) is the
optimizer's, restored with it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from utils.errors import UserError
from utils.hardware import autocast
from utils.launch.process_group import DistributedContext, raised_on_every_rank
from utils.training.compiled import compile_blocks
from utils.training.config import TrainConfig
from utils.training.objective import build_optimizer, build_scheduler, supervised_loss

logger = logging.getLogger(__name__)


class TrainStep:
    """Forward/backward of micro-batches and the optimizer update of one run's model, with what steps along with it:
    the learning-rate schedule, the fp16 scaler and the --ema average."""

    def __init__(
        self,
        config: TrainConfig,
        model: nn.Module,
        ctx: DistributedContext,
        *,
        precision: str,
        total_steps: int,
        class_weights: tuple[float, ...] | None,
    ) -> None:
        """``model``: the plain model on ``ctx.device`` (``raw_model``), which the forward pass calls wrapped in DDP
        and/or compiled (``model``); ``precision``: the autocast precision resolved from --precision/--amp and the
        device; ``total_steps``: the optimizer steps the schedule is planned over (a resumed run's scheduler state
        brings back the plan it was made with); ``class_weights``: --class-weights resolved (None = unweighted)."""
        self.config = config
        self.precision = precision
        self.raw_model = model
        self.device = device = ctx.device
        # The module the forward pass calls: the model's blocks compiled under --compile, in a copy that shares its
        # tensors (utils.training.compiled), in DDP when distributed.
        self.model = compile_blocks(model) if config.performance.compile else model
        if ctx.is_distributed:
            device_ids = [device.index] if device.type == "cuda" else None
            self.model = DistributedDataParallel(self.model, device_ids=device_ids)
        flags = config.optimisation
        self.optimizer = build_optimizer(flags, model.parameters())
        # Stepped after every update, except ReduceLROnPlateau: the loop steps it on the validation Dice (its warmup,
        # PlateauAfterWarmup, steps after every update).
        self.scheduler = build_scheduler(flags, self.optimizer, total_steps)
        self.scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
        # After DDP's wrapping, which broadcasts rank 0's weights: every rank's average starts from the same ones.
        self.ema = WeightAverage(model, flags.ema, self.optimizer) if flags.ema is not None else None
        # The encoder is not updated in the epochs (0-based) before this one: --freeze-encoder-epochs counted from
        # --start_from.
        freeze = config.model.freeze_encoder_epochs
        self.freeze_encoder_before_epoch = config.checkpoint.start_from - 1 + freeze if freeze else 0
        self._frozen: list[nn.Parameter] = []
        self._memory_format = torch.channels_last if config.performance.channels_last else torch.contiguous_format
        self._class_weights = None if class_weights is None else torch.tensor(class_weights, device=device)
        # fp16 runs leave skipping to GradScaler.
        self.guard = NonFiniteStepGuard(model, self.optimizer, device) if self.scaler is None else None
        # Sum and count of the finite losses since the last read (a skipped step's NaN would hide the others').
        self._losses = torch.zeros(2, device=device)

    def set_epoch(self, epoch: int) -> None:
        """Call before each epoch (numbered from 0): the encoder is frozen before ``freeze_encoder_before_epoch``."""
        frozen = epoch < self.freeze_encoder_before_epoch
        self._frozen = list(self.raw_model.encoder.parameters()) if frozen else []

    def __call__(self, micro_batches: Sequence[dict[str, torch.Tensor]]) -> None:
        """One whole optimizer step over ``micro_batches`` (gradients all-reduced on the last one only)."""
        self.begin()
        for index, batch in enumerate(micro_batches):
            self.accumulate(batch, len(micro_batches), sync_gradients=index + 1 == len(micro_batches))
        self.update()

    def begin(self) -> None:
        """Call before the first micro-batch of each optimizer step."""
        if self.guard is not None:
            self.guard.start_step()

    def accumulate(self, batch: dict[str, torch.Tensor], group_size: int, *, sync_gradients: bool) -> int:
        """Forward and backward of one micro-batch of a step of ``group_size``; returns its number of images."""
        images = batch["image"].to(self.device, non_blocking=True, memory_format=self._memory_format)
        masks = batch["mask"].to(self.device, non_blocking=True)
        # DDP all-reduces gradients only on the micro-batch that closes an accumulation group.
        ddp = isinstance(self.model, DistributedDataParallel)
        with self.model.no_sync() if ddp and not sync_gradients else contextlib.nullcontext():
            with autocast(self.device, self.precision):
                logits = self.model(images)
                loss = supervised_loss(logits, masks, self.config.model.classes, self._class_weights)
            scaled = loss / group_size
            if self.scaler is not None:
                self.scaler.scale(scaled).backward()
            else:
                scaled.backward()
        loss = loss.detach()
        self._losses += torch.stack([torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0), torch.isfinite(loss)])
        return images.shape[0]

    def update(self) -> None:
        """The optimizer update (skipped when the gradients are not finite), then the scheduler step and the average."""
        # Freezing by dropping the (already all-reduced) gradients, not by requires_grad: DDP's buckets stay as built,
        # every rank drops the same ones, and the optimizer skips parameters without a gradient (no update, no weight
        # decay, no moment), while the schedule of the other parameters is untouched.
        for parameter in self._frozen:
            parameter.grad = None
        if self.guard is not None:
            self.guard.step(self.config.optimisation.grad_clip)
        else:
            assert self.scaler is not None
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            if self.config.optimisation.grad_clip:
                nn.utils.clip_grad_norm_(self.raw_model.parameters(), self.config.optimisation.grad_clip)
            self.scaler.step(self.optimizer)  # skips the step itself when the gradients are not finite
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if not isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            self.scheduler.step()
        if self.ema is not None:
            self.ema.update()  # after the step: a skipped one leaves the average as it is

    def take_losses(self) -> torch.Tensor:
        """``[sum, count]`` of the finite losses since the previous call, on the device; resets them."""
        totals, self._losses = self._losses, torch.zeros_like(self._losses)
        return totals

    def skipped_steps(self, global_step: int, run_folder: Path) -> int:
        """Warn about the steps skipped for NaN/inf gradients since the previous call; stop the run at
        --max-nonfinite-steps in a row. Returns the run of them up to ``global_step`` (0: the latest step was applied;
        always 0 under GradScaler).

        Reads the device: call only where the loop synchronises anyway. Every rank counts the same steps (the
        gradients were all-reduced), so all of them stop at the same point without a collective.
        """
        if self.guard is None:
            return 0
        skipped, longest_run, current_run = self.guard.report()
        if skipped:
            logger.warning(
                f"{skipped} optimizer step(s) up to step {global_step} had NaN or inf gradients and were skipped "
                f"(weights unchanged)"
            )
        limit = self.config.optimisation.max_nonfinite_steps
        if limit and longest_run >= limit:
            diverged = UserError(
                f"training diverged: {longest_run} optimizer steps in a row (up to step {global_step}) had NaN or inf "
                f"loss or gradients and were skipped; the newest checkpoint in {run_folder} (if any) holds the last "
                f"good state. Lower --learning-rate, keep --grad-clip on, check the data, or raise "
                f"--max-nonfinite-steps (now {limit})"
            )
            raise raised_on_every_rank(diverged)  # every rank counts the same steps
        return current_run


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

    def report(self) -> tuple[int, int, int]:
        """Steps skipped since the previous report; the longest run of them in a row since then (a run may have
        started before it); the run up to now (0 when the latest step was applied). Reads the device: call where the
        loop synchronises anyway."""
        skipped, longest_run, current_run = torch.stack([self._skipped, self._longest_run, self._current_run]).tolist()
        self._skipped.zero_()
        self._longest_run.copy_(self._current_run)
        return skipped, longest_run, current_run


def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


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
