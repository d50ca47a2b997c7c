"""Progress as log lines, for runs whose output goes to a file (a cluster job's log) instead of a terminal.

Progress bars redraw one line with carriage returns: in a file that is thousands of fragments and no loss at all.
When stderr is not a terminal, or with ``--no-progress``, the bars are off and global rank 0 logs one line every
``--log-every`` optimizer steps (epoch, step in the epoch, loss, learning rate, images/s, ETA) and one line per
epoch (mean training loss of the epoch, and the validation scores when it validated). With a terminal the bars stay.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import TextIO

from utils.cli import stderr_is_terminal

logger = logging.getLogger(__name__)


def bars_wanted(*, is_main: bool, no_progress: bool, stream: TextIO | None = None) -> bool:
    """Progress bars only on global rank 0, on a terminal, and unless ``--no-progress``."""
    stream = sys.stderr if stream is None else stream
    return is_main and not no_progress and _is_terminal(stream)


def format_duration(seconds: float) -> str:
    """``1:02:03`` for hours, ``2:03`` below an hour."""
    whole = max(int(round(seconds)), 0)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


@dataclass
class ProgressLog:
    """The log lines that replace the bars (``enabled`` on global rank 0 without bars); the other ranks only count."""

    enabled: bool
    last_epoch: int
    steps_per_epoch: int
    max_steps: int = 0
    _epoch_loss_sum: float = 0.0
    _epoch_loss_count: float = 0.0
    _started: float | None = None
    _start_step: int = 0

    def start(self, global_step: int) -> None:
        """Begin measuring the step rate (the ETA uses this process's steps only: a resume's start-up is not one)."""
        self._started, self._start_step = time.perf_counter(), global_step

    def add_losses(self, loss_sum: float, count: float) -> None:
        """Finite losses of this epoch's steps (summed over ranks), for the epoch line's mean."""
        self._epoch_loss_sum += loss_sum
        self._epoch_loss_count += count

    def step_line(
        self, *, epoch: int, global_step: int, step_in_epoch: int, loss: float, lr: float, images_per_s: float
    ) -> None:
        """Log one step line; ``epoch`` counts from 0 as the loop's does."""
        if not self.enabled:
            return
        logger.info(
            "epoch %d/%d step %d/%d (global %d): loss %.4f, lr %.2e, %.1f img/s, ETA %s",
            epoch + 1,
            self.last_epoch,
            step_in_epoch,
            self.steps_per_epoch,
            global_step,
            loss,
            lr,
            images_per_s,
            self._eta(epoch, global_step, step_in_epoch),
        )

    def epoch_line(self, *, epoch_number: int, global_step: int, validation: tuple[float, float] | None) -> None:
        """Log the epoch's mean training loss and ``validation`` (Dice, IoU) if it validated; resets the mean."""
        count, total = self._epoch_loss_count, self._epoch_loss_sum
        self._epoch_loss_sum = self._epoch_loss_count = 0.0
        if not self.enabled:
            return
        mean = f"{total / count:.4f}" if count else "n/a"
        scores = f"; validation Dice {validation[0]:.4f}, IoU {validation[1]:.4f}" if validation else ""
        logger.info(
            "epoch %d/%d done (step %d): mean training loss %s%s", epoch_number, self.last_epoch, global_step, mean,
            scores,
        )  # fmt: skip

    def _eta(self, epoch: int, global_step: int, step_in_epoch: int) -> str:
        if self._started is None or global_step <= self._start_step:
            return "?"
        seconds_per_step = (time.perf_counter() - self._started) / (global_step - self._start_step)
        remaining = (self.last_epoch - epoch - 1) * self.steps_per_epoch + self.steps_per_epoch - step_in_epoch
        if self.max_steps:
            remaining = min(remaining, self.max_steps - global_step)
        return format_duration(max(remaining, 0) * seconds_per_step)


def _is_terminal(stream: TextIO) -> bool:
    return stderr_is_terminal(stream)
