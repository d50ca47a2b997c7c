"""--save-every-minutes: when a wall-time save of ``last.pth`` is due (Lightning's ``train_time_interval``).

Only global rank 0 reads its clock; the loop sends its answer to the other ranks on the stop agreement's all-reduce
(``utils.launch.process_group.StopAgreement``), so every rank saves at the same step.
"""

from __future__ import annotations

import time


def monotonic() -> float:
    """The clock of every timer, looked up at each reading (tests replace it to let minutes pass in milliseconds)."""
    return time.monotonic()


class SaveTimer:
    """Says once per interval that a save is due, then waits for ``saved()`` before counting the next interval."""

    def __init__(self, minutes: float) -> None:
        self.interval_s = minutes * 60.0
        self._last_save = monotonic()
        self._requested = False

    def due(self) -> bool:
        """True when the interval has passed since the last save and no save was asked for since (0 minutes: never)."""
        if not self.interval_s or self._requested:
            return False
        self._requested = monotonic() - self._last_save >= self.interval_s
        return self._requested

    def saved(self) -> None:
        """A save happened (by time or any other reason): the next interval starts now."""
        self._last_save = monotonic()
        self._requested = False
