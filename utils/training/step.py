"""One optimizer step: forward and backward over its micro-batches, then the guarded optimizer update.

``TrainStep`` is the object the training loop runs and the one the benchmark times, so the benchmark's compute-only
figure measures exactly what ``train.py`` does per step (autocast, gradient accumulation without all-reduce on the
first micro-batches, the non-finite guard, clipping, the scheduler step). It does no host synchronisation: losses
accumulate on the device until ``take_losses`` is called.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from utils.hardware import autocast
from utils.launch.process_group import DistributedContext
from utils.training.config import TrainConfig
from utils.training.model import wrap_for_training
from utils.training.nonfinite import NonFiniteStepGuard, SkipReport
from utils.training.objective import Optimization, supervised_loss


class TrainStep:
    """Forward/backward of micro-batches and the optimizer update of one run's model."""

    def __init__(
        self,
        config: TrainConfig,
        optimization: Optimization,
        model: nn.Module,
        ctx: DistributedContext,
        *,
        precision: str,
        class_weights: tuple[float, ...] | None,
    ) -> None:
        """``optimization``: the optimizer, its schedule (stepped after every update unless only the validation
        steps it: ReduceLROnPlateau on validation Dice) and the fp16 scaler; ``model``: the plain model on
        ``ctx.device`` (``raw_model``), which the forward pass calls wrapped in DDP and/or compiled (``model``);
        ``precision``: the autocast precision resolved from --precision/--amp and the device; ``class_weights``:
        --class-weights resolved (None = unweighted)."""
        self.config = config
        self.precision = precision
        # The encoder is not updated in the epochs (0-based) before this one: --freeze-encoder-epochs counted from
        # --start_from.
        freeze = config.model.freeze_encoder_epochs
        self.freeze_encoder_before_epoch = config.checkpoint.start_from - 1 + freeze if freeze else 0
        self.model = wrap_for_training(model, ctx, compile_model=config.performance.compile)
        self.raw_model = model
        self.optimizer = optimization.optimizer
        # ReduceLROnPlateau steps on validation Dice, in the loop; only its warmup (PlateauAfterWarmup, if any) and the
        # other schedules step after every update.
        plateau = isinstance(optimization.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        self.scheduler = None if plateau else optimization.scheduler
        self.scaler = optimization.scaler
        self.device = device = ctx.device
        # The DDP wrapper, if any (--compile compiles the blocks inside it: utils.training.compiled).
        self._ddp = self.model if isinstance(self.model, DistributedDataParallel) else None
        self._memory_format = torch.channels_last if config.performance.channels_last else torch.contiguous_format
        self._class_weights = None if class_weights is None else torch.tensor(class_weights, device=device)
        # fp16 runs leave skipping to GradScaler (see utils.training.nonfinite).
        self.guard = NonFiniteStepGuard(model, self.optimizer, device) if self.scaler is None else None
        # Sum and count of the finite losses since the last read (a skipped step's NaN would hide the others').
        self._loss_sum = torch.zeros((), device=device)
        self._loss_count = torch.zeros((), device=device)
        encoder = getattr(model, "encoder", None) if self.freeze_encoder_before_epoch else None
        self._encoder_parameters = list(encoder.parameters()) if encoder is not None else []
        self._encoder_frozen = bool(self._encoder_parameters)

    def set_epoch(self, epoch: int) -> None:
        """Call before each epoch (numbered from 0): the encoder is frozen before ``freeze_encoder_before_epoch``."""
        self._encoder_frozen = bool(self._encoder_parameters) and epoch < self.freeze_encoder_before_epoch

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
        no_sync = self._ddp.no_sync() if self._ddp is not None and not sync_gradients else contextlib.nullcontext()
        with no_sync:
            with autocast(self.device, self.precision):
                logits = self.model(images)
                loss = supervised_loss(logits, masks, self.config.model.classes, self._class_weights)
            scaled = loss / group_size
            if self.scaler is not None:
                self.scaler.scale(scaled).backward()
            else:
                scaled.backward()
        loss = loss.detach()
        self._loss_sum += torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0)
        self._loss_count += torch.isfinite(loss)
        return images.shape[0]

    def update(self) -> None:
        """The optimizer update (skipped when the gradients are not finite), then the scheduler step."""
        if self._encoder_frozen:
            # Freezing by dropping the (already all-reduced) gradients, not by requires_grad: DDP's buckets stay as
            # built, every rank drops the same ones, and the optimizer skips parameters without a gradient (no
            # update, no weight decay, no moment), while the schedule of the other parameters is untouched.
            for parameter in self._encoder_parameters:
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
        if self.scheduler is not None:
            self.scheduler.step()

    def take_losses(self) -> torch.Tensor:
        """``[sum, count]`` of the finite losses since the previous call, on the device; resets them."""
        totals = torch.stack([self._loss_sum, self._loss_count])
        self._loss_sum.zero_()
        self._loss_count.zero_()
        return totals

    def skip_report(self) -> SkipReport | None:
        """Steps skipped for NaN/inf gradients since the previous report (reads the device); None under GradScaler."""
        return self.guard.report() if self.guard is not None else None
