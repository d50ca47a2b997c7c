"""--patience N [--min-delta D]: stop a run after N validations without an improvement of the validation Dice by more
than D.

The count lives in ``TrainPosition.validations_without_improvement`` and travels in every checkpoint, so a resumed run
stops where the uninterrupted one would have. Every rank receives the same Dice (broadcast by the validation), so
every rank reaches the same decision without talking to the others. ``config``: the optimisation section (``patience``
0 never stops).
"""

from __future__ import annotations

from utils.training.config import OptimisationSection


def validations_without_improvement(
    config: OptimisationSection, dice: float, best_before: float, count_before: int
) -> int:
    """The count after a validation of ``dice``, given the best Dice of the earlier validations (-inf: none)."""
    if dice > best_before + config.min_delta:
        return 0
    return count_before + 1


def should_stop(config: OptimisationSection, count: int) -> bool:
    return config.patience > 0 and count >= config.patience


def reason(config: OptimisationSection, best_dice: float, best_epoch: int) -> str:
    """The run's last line when it stops early."""
    return (
        f"early stopping: no improvement of validation Dice above {config.min_delta:g} in {config.patience} "
        f"validation{'s' if config.patience != 1 else ''}; best {best_dice:.4f} at epoch {best_epoch}"
    )
