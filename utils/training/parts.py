"""The parts of a training run the loop works on, built and restored by ``utils.training.setup``: read by the loop,
its checkpointer (``utils.checkpoint.checkpointer``) and its log (``utils.training.run_log``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from utils.checkpoint.format import TrainPosition
from utils.checkpoint.run_folder import RunFolder
from utils.training.config import TrainConfig
from utils.training.data import Loaders, TrainData
from utils.training.sampler import BatchPlan
from utils.training.step import TrainStep, WeightAverage


@dataclass
class TrainParts:
    """Everything the loop works on, built (and restored from a checkpoint) by ``utils.training.setup``."""

    step: TrainStep
    """The optimizer step: the model (plain, and as the forward pass calls it: DDP and/or compiled), the optimizer, its
    schedule, the fp16 scaler and the --ema average."""
    data: TrainData
    loaders: Loaders
    """This rank's sampler, training loader and validation loader (if it validates)."""
    batch_plan: BatchPlan
    config: TrainConfig
    """The run's flags (a resumed run's with its checkpoint's epoch plan)."""
    run_folder: RunFolder
    """Where the run's files go (locked on global rank 0, which chose it)."""
    position: TrainPosition
    """Where the run stands: the loop moves it on; the log, the validation and the checkpoints read it."""
    resume_images_in_epoch: int
    """Global images of epoch ``position.epoch`` already trained by the run this one resumes."""
    resumed: bool = False
    """Whether ``position`` is a resumed checkpoint's (TensorBoard's step axis goes on from it)."""

    @property
    def raw_model(self) -> nn.Module:
        """The plain model: evaluated, and saved in checkpoints."""
        return self.step.raw_model

    @property
    def model_args(self) -> dict[str, Any]:
        """The model's constructor arguments, stored in every checkpoint."""
        return self.raw_model.constructor_args()

    @property
    def scheduler(self) -> Any:
        return self.step.scheduler

    @property
    def ema(self) -> WeightAverage | None:
        """--ema: the average of the weights (``TrainStep.update``); it validates and is saved as the model."""
        return self.step.ema

    @property
    def run_args(self) -> dict[str, Any]:
        """The run's flags as a plain dict, stored in every checkpoint."""
        return self.config.as_dict()

    @property
    def evaluated_model(self) -> nn.Module:
        """What validates: the average of the weights with --ema, else the unwrapped model."""
        return self.ema.module if self.ema is not None else self.raw_model
