"""--ema: the average of the weights (hand values, skipped steps), what validates and is saved, exact resume, and
identical averages on two real processes (a two-process run killed and restarted with --ema ends bit-identical:
``tests/training/test_faults_elastic.py``)."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.conftest import TrainRunner, assert_same_training_state, load_checkpoint, run_ranks
from tests.helpers import tiny_unet
from utils.evaluation import score_batches
from utils.training.step import NonFiniteStepGuard, WeightAverage

DECAY = 0.5


class Scale(nn.Module):
    """One weight and one buffer: small enough to follow by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([1.0, 2.0]))
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * x).sum()


def test_the_average_on_hand_values_and_skipped_steps_leave_it_alone() -> None:
    model = Scale()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.0, fused=True)
    guard = NonFiniteStepGuard(model, optimizer, torch.device("cpu"))
    average = WeightAverage(model, DECAY, optimizer)
    assert torch.equal(average.module.weight, torch.tensor([1.0, 2.0]))  # starts from the weights

    def step(gradient: list[float]) -> None:
        guard.start_step()
        model.weight.grad = torch.tensor(gradient)
        model.seen += 1  # a forward pass's buffer update (the guard puts it back on a skipped step)
        guard.step(grad_clip=0.0)
        optimizer.zero_grad(set_to_none=True)
        average.update()

    step([1.0, -1.0])  # Adam's first step moves each weight by the learning rate: [0.9, 2.1]
    live = model.weight.detach().clone()
    assert torch.allclose(live, torch.tensor([0.9, 2.1]))
    expected = DECAY * torch.tensor([1.0, 2.0]) + (1 - DECAY) * live
    assert torch.allclose(average.module.weight, expected) and average.module.seen.item() == 1.0

    step([float("nan"), 1.0])  # skipped: no weight, buffer or average moves
    assert torch.equal(model.weight, live) and model.seen.item() == 1.0
    assert torch.equal(average.module.weight, expected) and average.module.seen.item() == 1.0

    step([1.0, -1.0])
    expected = DECAY * expected + (1 - DECAY) * model.weight.detach()
    assert torch.allclose(average.module.weight, expected) and not torch.equal(expected, model.weight)

    # An average rebuilt on the restored optimizer (a resume) continues exactly; an update without a step is a no-op.
    restored = WeightAverage(model, DECAY, optimizer)
    restored.load_state_dict(average.state_dict())
    step([1.0, -1.0])  # updates ``average``
    restored.update()
    assert torch.equal(restored.module.weight, average.module.weight)
    restored.update()
    assert torch.equal(restored.module.weight, average.module.weight)


def test_the_average_skips_steps_without_the_fused_optimizer_too() -> None:
    model = Scale()
    optimizer = torch.optim.RMSprop(model.parameters(), lr=0.1, foreach=True)
    guard = NonFiniteStepGuard(model, optimizer, torch.device("cpu"))
    average = WeightAverage(model, DECAY, optimizer)
    model.weight.grad = torch.tensor([float("inf"), 1.0])
    guard.step(grad_clip=1.0)  # the first step is skipped: the optimizer has no state yet
    average.update()
    assert torch.equal(average.module.weight, torch.tensor([1.0, 2.0]))
    model.weight.grad = torch.tensor([1.0, 1.0])
    guard.step(grad_clip=1.0)
    average.update()
    assert torch.allclose(average.module.weight, DECAY * torch.tensor([1.0, 2.0]) + (1 - DECAY) * model.weight)


def test_steps_that_grad_scaler_skips_leave_the_average_alone() -> None:
    """fp16's path: GradScaler (here on the CPU) skips the fused step itself when the scaled gradients overflow."""
    model = nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    average = WeightAverage(model, DECAY, optimizer)
    history = []
    for overflow in (True, False, True):
        loss = model(torch.ones(1, 2)).sum() * (math.inf if overflow else 1.0)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        before = average.module.weight.detach().clone()
        average.update()
        history.append((before, average.module.weight.detach().clone(), model.weight.detach().clone()))
    (before, after, live), (applied_before, applied, applied_live), (_, last, _) = history
    assert torch.equal(after, before) and torch.equal(after, live)  # nothing moved
    assert torch.allclose(applied, DECAY * applied_before + (1 - DECAY) * applied_live)
    assert not torch.equal(applied, applied_before)
    assert torch.equal(last, applied)


def test_decay_outside_zero_one_is_refused(runner: TrainRunner, capsys: pytest.CaptureFixture) -> None:
    assert runner.main("bad", "--ema", "1") == 2
    assert "--ema must be a finite number in (0, 1)" in capsys.readouterr().err


def test_an_ema_run_validates_and_saves_the_average_and_resumes_bit_exactly(
    runner: TrainRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    from utils.training import loop

    validated: list[dict[str, torch.Tensor]] = []

    def spy(model: nn.Module, *args, **kwargs):
        validated.append({key: value.clone() for key, value in model.state_dict().items()})
        return score_batches(model, *args, **kwargs)

    monkeypatch.setattr(loop, "score_batches", spy)
    flags = ["-e", "2", "--ema", "0.8", "--log-every", "4"]
    assert runner.main("straight", *flags) == 0
    straight = runner.run_dir("straight")
    epoch1, last = (load_checkpoint(straight / name) for name in ("checkpoint_epoch1.pth", "last.pth"))
    # model_state is the average (what inference reads), live_model_state the weights being trained.
    assert last["model_state"].keys() == last["live_model_state"].keys()
    weight = "inc.double_conv.0.weight"
    assert not torch.equal(last["model_state"][weight], last["live_model_state"][weight])
    # Validation scored the average: the weights it was given are model_state of the same epoch, not the live ones.
    assert len(validated) == 2
    for scored, saved in zip(validated, (epoch1, last), strict=True):
        assert all(torch.equal(value, saved["model_state"][key]) for key, value in scored.items())
        assert not torch.equal(scored[weight], saved["live_model_state"][weight])
    # best.pth holds an average too: its epoch's.
    best = load_checkpoint(straight / "best.pth")
    epoch_file = load_checkpoint(straight / f"checkpoint_epoch{best['epoch']}.pth")
    assert all(torch.equal(value, epoch_file["model_state"][key]) for key, value in best["model_state"].items())
    # predict and evaluate read model_state: the average.
    from utils.checkpoint.files import read_model_weights

    inference = read_model_weights(straight / "best.pth").state_dict
    assert torch.equal(inference[weight], best["model_state"][weight])

    # Stopped mid-epoch and resumed: live weights, optimizer and average bit-identical to the uninterrupted run.
    assert runner.main("stopped", *flags, "--max-steps", "5") == 0
    assert runner.main("stopped", *flags, "--resume", "auto") == 0
    assert_same_training_state(straight / "last.pth", runner.run_dir("stopped") / "last.pth")  # model_state: average
    resumed = load_checkpoint(runner.run_dir("stopped") / "last.pth")
    for key, value in last["live_model_state"].items():
        assert torch.equal(value, resumed["live_model_state"][key]), key


def _average_on_rank(rank: int, store_path: str, results: str) -> None:
    """One rank of a DDP run whose ranks see different data; saves its own average for the parent to compare."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        model = tiny_unet(0)
        ddp = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        guard = NonFiniteStepGuard(model, optimizer, torch.device("cpu"))
        average = WeightAverage(model, 0.7, optimizer)
        generator = torch.Generator().manual_seed(100 + rank)  # each rank its own images
        for _ in range(4):
            guard.start_step()
            images = torch.rand(2, 3, 32, 32, generator=generator)
            ddp(images).square().mean().backward()
            guard.step(grad_clip=1.0)
            optimizer.zero_grad(set_to_none=True)
            average.update()
        torch.save(
            {"average": average.state_dict(), "live": model.state_dict()}, os.path.join(results, f"rank{rank}.pth")
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="gloo processes")
def test_two_real_processes_hold_the_same_average_without_talking(tmp_path: Path) -> None:
    run_ranks(_average_on_rank, (str(tmp_path / "store"), str(tmp_path)), 2, backward=True)
    first, second = (load_checkpoint(tmp_path / f"rank{rank}.pth") for rank in range(2))
    start = tiny_unet(0)
    parameters = {name for name, _ in start.named_parameters()}
    for key, value in first["average"].items():
        if key in parameters:
            assert torch.equal(value, second["average"][key]), key
        else:
            # BatchNorm statistics are each rank's own, in the live model too (DDP broadcasts rank 0's at the next
            # forward; --sync-bn makes them equal): the average holds a copy of its rank's.
            assert torch.equal(value, first["live"][key]) and torch.equal(second["average"][key], second["live"][key])
    assert any(not torch.equal(first["live"][key], second["live"][key]) for key in first["live"] if "running" in key)
    start = start.state_dict()
    weight = "inc.double_conv.0.weight"
    # The ranks' data differ, so only the synchronised gradients can make the averages equal; and they moved.
    assert not torch.equal(first["average"][weight], start[weight])
    assert not torch.equal(first["average"][weight], first["live"][weight])
