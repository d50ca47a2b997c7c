"""NaN/inf gradients: the step is skipped without touching the model, a run of them stops training with a clear error,
and no checkpoint ever holds a state after a skipped step or non-finite weights."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

import train
from tests.conftest import TrainRunner, load_checkpoint
from tests.helpers import one_error_line, read_metrics
from unet import UNet
from utils.training.config import parse_config
from utils.training.objective import build_optimizer, segmentation_loss
from utils.training.step import NonFiniteStepGuard


def _floating_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # num_batches_tracked counts forward passes, skipped or not; BatchNorm (momentum 0.1) does not use it.
    return {key: value.clone() for key, value in model.state_dict().items() if value.is_floating_point()}


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value.clone() for state in optimizer.state.values() for value in state.values()]


@pytest.mark.parametrize(("optimizer", "grad_clip"), [("adamw", 1.0), ("rmsprop", 0.0)])
def test_a_step_with_nan_gradients_changes_neither_weights_nor_statistics(optimizer: str, grad_clip: float) -> None:
    torch.manual_seed(0)
    model = UNet(3, 1, base_channels=8)
    settings = parse_config(["--optimizer", optimizer, "-l", "1e-3"]).optimisation
    sgd = build_optimizer(settings, model.parameters())
    guard = NonFiniteStepGuard(model, sgd, torch.device("cpu"))
    images = torch.rand(2, 3, 32, 48)
    masks = torch.randint(0, 2, (2, 32, 48))

    def train_step(batch: torch.Tensor) -> None:
        guard.start_step()
        segmentation_loss(model(batch), masks, 1).backward()
        guard.step(grad_clip)
        sgd.zero_grad(set_to_none=True)

    train_step(images)  # a real step first, so the optimizer has state to protect
    weights, moments = _floating_state(model), _optimizer_tensors(sgd)
    poisoned = images.clone()
    poisoned[0, :, :4, :4] = float("nan")  # the forward pass also feeds NaN into the BatchNorm statistics
    train_step(poisoned)
    for key, value in _floating_state(model).items():
        assert torch.equal(value, weights[key]), key
    for before, after in zip(moments, _optimizer_tensors(sgd), strict=True):
        assert torch.equal(before, after)
    assert guard.report() == (1, 1, 1)  # skipped, longest run in a row, current run

    train_step(images)
    assert not torch.equal(model.state_dict()["inc.double_conv.0.weight"], weights["inc.double_conv.0.weight"])
    assert guard.report() == (0, 1, 0)  # the run of one ended with the applied step, still the longest since


@pytest.fixture
def absurd_learning_rate(monkeypatch: pytest.MonkeyPatch):
    """Lets train.main run with a learning rate its flag check refuses (the way to make a real run diverge).

    ``-l`` above 1 is refused up front; the guard below it still matters (fp16 overflow, bad data, a learning rate
    that is merely too large), and a huge rate is the reliable way to make a real run produce NaN gradients.
    """

    def use(learning_rate: float) -> None:
        def parse_with_rate(argv):
            config = parse_config(argv)
            optimisation = dataclasses.replace(config.optimisation, learning_rate=learning_rate)
            return dataclasses.replace(config, optimisation=optimisation)

        monkeypatch.setattr(train, "parse_config", parse_with_rate)

    return use


def test_the_flag_check_refuses_the_learning_rates_these_tests_need(runner: TrainRunner, capsys) -> None:
    for rate in ("1e30", "1e39"):
        assert runner.main("refused", "-l", rate) == 2
        assert "--learning-rate" in one_error_line(capsys.readouterr().err)


def test_nonfinite_steps_in_a_row_stop_the_run_and_keep_the_last_good_checkpoint(
    runner: TrainRunner, capsys: pytest.CaptureFixture, absurd_learning_rate
) -> None:
    # A learning rate typed with a wrong exponent: step 1 takes the weights to ~1e30, from there every loss is NaN.
    absurd_learning_rate(1e30)
    code = runner.main(
        "diverged", "-e", "3", "--save-every-steps", "1", "--log-every", "1",
        "--max-nonfinite-steps", "3",
    )  # fmt: skip
    assert code == 2
    error = one_error_line(capsys.readouterr().err)
    assert "3 optimizer steps in a row (up to step 4) had NaN or inf" in error
    assert "--learning-rate" in error and "--max-nonfinite-steps" in error

    run_dir = runner.run_dir("diverged")
    last = load_checkpoint(run_dir / "last.pth")
    assert last["global_step"] == 1, "the saves after skipped steps must not replace the last good state"
    assert all(torch.isfinite(value).all() for value in last["model_state"].values() if value.is_floating_point())
    losses = [event["loss"] for event in read_metrics(run_dir, event="train")]
    assert math.isfinite(losses[0]) and not any(math.isfinite(loss) for loss in losses[1:])


def test_weights_that_became_nonfinite_are_never_saved(
    runner: TrainRunner, capsys: pytest.CaptureFixture, absurd_learning_rate
) -> None:
    # Beyond float32's range: the first step's finite gradients already make the weights inf.
    absurd_learning_rate(1e39)
    assert runner.main("overflow", "-e", "1", "--save-every-steps", "1") == 2
    err = one_error_line(capsys.readouterr().err)
    assert err.startswith("Error: the weights became NaN or inf by step 1") and "--learning-rate" in err
    assert not list(Path(runner.run_dir("overflow")).glob("*.pth"))
