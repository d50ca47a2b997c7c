"""Learning-rate schedules: poly and warmup on hand values, and the plan a checkpoint stores (real runs)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TrainRunner, assert_same_training_state, load_checkpoint
from tests.helpers import read_metrics
from utils.training.config import OptimisationSection, parse_config
from utils.training.objective import PlateauAfterWarmup, StepSchedule, build_scheduler

# The runner's data: 16 images, 10 % validation -> 15 training images; batch 2 -> 8 steps per epoch.
STEPS_PER_EPOCH = 8


def test_poly_on_hand_values() -> None:
    poly = StepSchedule(100, shape="poly")
    assert poly(0) == 1.0
    assert poly(50) == pytest.approx(0.5**0.9)  # 0.5359
    assert poly(75) == pytest.approx(0.25**0.9)
    assert poly(100) == 0.0
    assert poly(120) == 0.0  # past the plan: stays at 0
    assert StepSchedule(0, shape="poly")(3) == 1.0  # no plan: constant


def test_warmup_on_hand_values() -> None:
    # N = 4: (k + 1) / 5 for k = 0..3, then 1 (nothing planned after it): never exactly 0, the peak at step N.
    assert [StepSchedule(0, 4)(k) for k in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])
    assert StepSchedule(0, 10)(0) == pytest.approx(1 / 11)
    assert StepSchedule(0, 10)(5) == pytest.approx(6 / 11)
    assert StepSchedule(0, 10)(10) == 1.0
    assert StepSchedule(10, 0)(0) == 1.0  # no warmup


def test_the_schedule_after_the_warmup_spans_the_remaining_steps() -> None:
    # 10 steps of warmup, then poly over the remaining 90.
    poly = StepSchedule(100, 10, "poly")
    assert poly(4) == pytest.approx(5 / 11)
    assert poly(10) == 1.0
    assert poly(55) == pytest.approx(0.5**0.9)
    assert poly(100) == 0.0
    assert StepSchedule(100, 10, "cosine")(55) == pytest.approx(0.5)
    # Without warmup the cosine is the one the default run always had.
    assert StepSchedule(100)(25) == pytest.approx(0.5 * (1 + 2**-0.5))


def lrs_of(scheduler_config: OptimisationSection, steps: int, total_steps: int = 20) -> list[float]:
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    scheduler = build_scheduler(scheduler_config, optimizer, total_steps)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_the_torch_schedulers_follow_the_pure_functions() -> None:
    config = parse_config(["-l", "0.1", "--scheduler", "poly", "--warmup-steps", "4"]).optimisation
    expected = [0.1 * StepSchedule(20, 4, "poly")(k) for k in range(21)]
    assert lrs_of(config, 21) == pytest.approx(expected)
    assert expected[:5] == pytest.approx([0.02, 0.04, 0.06, 0.08, 0.1]) and expected[20] == 0.0


def test_plateau_after_warmup_warms_up_then_reduces_only_after_it() -> None:
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    settings = parse_config(["-l", "0.1", "--scheduler", "plateau", "--warmup-steps", "4"]).optimisation
    scheduler = build_scheduler(settings, optimizer, 0)
    assert isinstance(scheduler, PlateauAfterWarmup)
    seen = []
    for _ in range(6):
        seen.append(optimizer.param_groups[0]["lr"])
        scheduler.step(0.5)  # validations inside the warmup do not count towards the plateau's patience
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.02, 0.04, 0.06, 0.08, 0.1, 0.1])
    assert scheduler.plateau.num_bad_epochs == 1  # the one validation after the warmup (the first is the best)
    for _ in range(6):
        scheduler.step(0.5)  # flat Dice: after its patience of 5, ReduceLROnPlateau divides the rate by 10
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01)
    scheduler.step()  # the warmup is over: it no longer touches the rate
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01)
    # The state round-trips.
    other_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    other = PlateauAfterWarmup(other_optimizer, 4)
    other.load_state_dict(scheduler.state_dict())
    assert other.warmup.last_epoch == scheduler.warmup.last_epoch and other.plateau.best == scheduler.plateau.best


def test_poly_with_warmup_is_planned_once_and_a_resumed_run_continues_the_curve(runner: TrainRunner) -> None:
    flags = ["-e", "2", "--scheduler", "poly", "--warmup-steps", "5", "--log-every", "1"]
    assert runner.main("straight", *flags) == 0
    straight = runner.run_dir("straight")
    last = load_checkpoint(straight / "last.pth")
    total = 2 * STEPS_PER_EPOCH
    assert last["scheduler"]["lr_lambdas"] == [{"total_steps": total, "warmup_steps": 5, "shape": "poly"}]
    # metrics.jsonl logs the rate after each step's scheduler step: the factor of the next update.
    logged = [event["lr"] for event in read_metrics(straight, event="train")]
    expected = [1e-3 * StepSchedule(total, 5, "poly")(k) for k in range(1, total + 1)]
    assert logged == pytest.approx(expected)
    assert logged[3] == pytest.approx(1e-3 * 5 / 6) and logged[-1] == 0.0

    # Stopped inside the warmup and resumed with other --epochs: the stored plan wins, and the run ends bit-identical.
    assert runner.main("stopped", *flags, "--max-steps", "3") == 0
    resume = ["-e", "5", "--scheduler", "poly", "--warmup-steps", "5", "--log-every", "1", "--resume", "auto"]
    assert runner.main("stopped", *resume) == 0
    assert_same_training_state(straight / "last.pth", runner.run_dir("stopped") / "last.pth")
    resumed = [event["lr"] for event in read_metrics(runner.run_dir("stopped"), event="train")]
    assert resumed == pytest.approx(logged)


def test_a_resume_with_another_warmup_is_refused(runner: TrainRunner, capsys: pytest.CaptureFixture) -> None:
    assert runner.main("warm", "-e", "1", "--warmup-steps", "2", "--max-steps", "2") == 0
    assert runner.main("warm", "-e", "1", "--warmup-steps", "3", "--resume", "auto") == 2
    assert "--warmup-steps 2" in capsys.readouterr().err
