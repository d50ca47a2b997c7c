"""--patience/--min-delta: real runs that stop, with the count surviving a resume (the rule on hand values:
tests/training/test_trainer_units.py)."""

from __future__ import annotations

import pytest

from tests.conftest import TrainRunner, load_checkpoint
from tests.helpers import read_metrics

# The runner's data: 16 images, 10 % validation -> 15 training images; batch 2 -> 8 steps per epoch.
STEPS_PER_EPOCH = 8


def test_a_run_whose_dice_cannot_improve_enough_stops_after_the_second_validation(
    runner: TrainRunner, caplog: pytest.LogCaptureFixture
) -> None:
    # No Dice can beat another by more than 0.99 unless it was below 0.01: the 2nd validation does not improve.
    assert runner.main("flat", "-e", "5", "--patience", "1", "--min-delta", "0.99", "-l", "1e-6") == 0
    run_dir = runner.run_dir("flat")
    validations = read_metrics(run_dir, event="val")
    assert [event["epoch"] for event in validations] == [1, 2]
    last = load_checkpoint(run_dir / "last.pth")
    assert (last["epoch"], last["global_step"], last["validations_without_improvement"]) == (2, 16, 1)
    assert last["best_epoch"] == 1 and last["best_dice"] == validations[0]["dice"]
    assert caplog.records[-1].getMessage() == (
        f"Stopped at epoch 2, step 16; early stopping: no improvement of validation Dice above 0.99 in 1 validation; "
        f"best {validations[0]['dice']:.4f} at epoch 1"
    )


def test_the_count_survives_a_resume(runner: TrainRunner) -> None:
    flags = ["-e", "6", "--patience", "2", "--min-delta", "0.99", "-l", "1e-6", "--save_every", "0"]
    assert runner.main("straight", *flags) == 0
    straight = load_checkpoint(runner.run_dir("straight") / "last.pth")
    assert (straight["epoch"], straight["validations_without_improvement"]) == (3, 2)

    # Stopped after epoch 2 (count 1) plus 3 steps: the resumed run stops at epoch 3 too, not at epoch 4.
    assert runner.main("stopped", *flags, "--max-steps", str(2 * STEPS_PER_EPOCH + 3)) == 0
    stopped = load_checkpoint(runner.run_dir("stopped") / "last.pth")
    assert (stopped["epoch"], stopped["validations_without_improvement"]) == (2, 1)
    assert runner.main("stopped", *flags, "--resume", "auto") == 0
    resumed = load_checkpoint(runner.run_dir("stopped") / "last.pth")
    assert (resumed["epoch"], resumed["global_step"], resumed["validations_without_improvement"]) == (3, 24, 2)
    assert [event["epoch"] for event in read_metrics(runner.run_dir("stopped"), event="val")] == [1, 2, 3]
