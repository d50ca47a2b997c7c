"""--patience N [--min-delta D]: stop a run after N validations without an improvement of the validation Dice by more
than D.

The count lives in ``TrainPosition.validations_without_improvement`` and travels in every checkpoint, so a resumed run
stops where the uninterrupted one would have. Every rank receives the same Dice (broadcast by the validation), so
every rank reaches the same decision without talking to the others.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EarlyStopping:
    """When to stop (from --patience and --min-delta); ``patience`` 0 never stops."""

    patience: int = 0
    min_delta: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.patience > 0

    def validations_without_improvement(self, dice: float, best_before: float, count_before: int) -> int:
        """The count after a validation of ``dice``, given the best Dice of the earlier validations (-inf: none)."""
        if dice > best_before + self.min_delta:
            return 0
        return count_before + 1

    def should_stop(self, count: int) -> bool:
        return self.enabled and count >= self.patience

    def reason(self, best_dice: float, best_epoch: int) -> str:
        """The run's last line when it stops early."""
        return (
            f"early stopping: no improvement of validation Dice above {self.min_delta:g} in {self.patience} "
            f"validation{'s' if self.patience != 1 else ''}; best {best_dice:.4f} at epoch {best_epoch}"
        )
