"""``--tensorboard``: the run's scalars and a few validation images as TensorBoard events in ``<run>/tensorboard/``.

The scalars are those of ``metrics.jsonl`` (training loss, learning rate, images/s; validation Dice and IoU, their
means and per class), all on the global-step axis. A resumed run writes into the same folder and continues that axis:
its writer starts with ``purge_step`` = the resumed step + 1, so TensorBoard hides what the interrupted run had logged
after its checkpoint and each step is shown once, with the resumed run's values. Only global rank 0 writes (the
caller decides), and ``torch.utils.tensorboard`` is imported only when the flag is given.

    tensorboard --logdir checkpoints        # every run folder below, one run each
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import torch

from utils.errors import ConfigError

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install tensorboard"


class TensorBoardLog:
    """The event writer of one run folder."""

    def __init__(self, log_dir: Path, *, resumed_step: int | None) -> None:
        """``resumed_step``: the global step the run continues from (None for a run that starts at step 0)."""
        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError(f"--tensorboard needs the tensorboard package: {INSTALL_HINT}, or drop --tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        purge_step = None if resumed_step is None else resumed_step + 1
        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def log_train(self, global_step: int, *, loss: float, lr: float, images_per_s: float) -> None:
        self._writer.add_scalar("train/loss", loss, global_step)
        self._writer.add_scalar("train/learning_rate", lr, global_step)
        self._writer.add_scalar("train/images_per_s", images_per_s, global_step)
        self._writer.flush()

    def log_val(self, global_step: int, result: Any, samples: dict[str, Any] | None) -> None:
        """``result``: an EvalResult; ``samples``: a validation batch's ``image``, ``true`` and ``pred`` (classes)."""
        self._writer.add_scalar("val/dice", result.dice, global_step)
        self._writer.add_scalar("val/iou", result.iou, global_step)
        for index, (dice, iou) in enumerate(zip(result.per_class_dice, result.per_class_iou, strict=True)):
            self._writer.add_scalar(f"val/dice/class_{index}", dice, global_step)
            self._writer.add_scalar(f"val/iou/class_{index}", iou, global_step)
        if samples is not None:
            n_classes = max(len(result.per_class_dice), 2)
            self._writer.add_images("val/image", _as_images(samples["image"]), global_step)
            self._writer.add_images("val/truth", class_images(samples["true"], n_classes), global_step)
            self._writer.add_images("val/prediction", class_images(samples["pred"], n_classes), global_step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def class_images(classes: torch.Tensor, n_classes: int) -> torch.Tensor:
    """Class indices ``[N, H, W]`` (or one ``[H, W]``) as grey ``[N, 1, H, W]`` images in [0, 1], classes spread out.

    Void pixels (negative indices) are black like class 0.
    """
    classes = classes.detach().cpu()
    if classes.dim() == 2:
        classes = classes.unsqueeze(0)
    return (classes.clamp(min=0).float() / (n_classes - 1)).clamp(max=1).unsqueeze(1)


def _as_images(images: torch.Tensor) -> torch.Tensor:
    images = images.detach().float().cpu()
    if images.dim() == 3:
        images = images.unsqueeze(0)
    return images.clamp(0, 1)
