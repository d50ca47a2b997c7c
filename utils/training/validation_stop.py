"""A stop signal during validation ends it at the next batch: the trained state is saved at once, not after it.

With a short grace period (SLURM's, Kubernetes') a validation that runs to its end, followed by one more training
batch, can lose the whole trained epoch. So rank 0 scores validation batches only while no signal has arrived
(``until_stopped``); when one arrives mid-validation, the partial score is dropped, every rank learns it from the
score broadcast (``StoppedValidation``), and the loop saves ``INTERRUPTED.pth`` with the position of the epoch's last
step (every batch trained, the validation not done). The resumed run has no batch of that epoch left, so it goes
straight to the epoch's end and repeats the validation.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from utils.launch.signals import InterruptFlag


@dataclass(frozen=True)
class StoppedValidation:
    """What rank 0 broadcasts instead of a Dice score when a signal cut its validation short."""

    signum: int


class ValidationStopped(Exception):
    """Raised on every rank by the loop's validation when rank 0's was cut short by ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"validation stopped by signal {signum}")
        self.signum = signum


class UntilStopped:
    """``loader``'s batches while ``flag`` has recorded no signal; ``stopped_by`` tells which signal ended it."""

    def __init__(self, loader: Iterable[Any], flag: InterruptFlag) -> None:
        self._loader = loader
        self._flag = flag
        self.stopped_by = 0

    def __len__(self) -> int:
        return len(self._loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        for batch in self._loader:
            if self._flag.signum:
                # Stop before computing on the batch; leaving the loop lets the loader shut its workers down.
                self.stopped_by = self._flag.signum
                return
            yield batch
