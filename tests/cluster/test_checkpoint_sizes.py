"""Checkpoints sized for what they are for: best.pth and best-K.pth weights-only, the resumable files full-state."""

from __future__ import annotations

import re

import pytest
import torch

from tests.conftest import TrainRunner, load_checkpoint
from tests.helpers import one_error_line, tiny_unet
from utils.checkpoint.checkpointer import budget_line
from utils.checkpoint.files import read_model_weights
from utils.training.config import CheckpointSection


def test_best_files_hold_the_weights_only_and_still_load_everywhere(
    runner: TrainRunner, capsys: pytest.CaptureFixture
) -> None:
    assert runner.main("sized", "-e", "2", "--keep-best", "2") == 0
    run_dir = runner.run_dir("sized")
    out, err = capsys.readouterr()
    assert "this run keeps at most 4 full-state and 3 weights-only files" in out + err  # last, INTERRUPTED, 2 epochs

    last, best = load_checkpoint(run_dir / "last.pth"), load_checkpoint(run_dir / "best.pth")
    assert "optimizer" in last and "optimizer" not in best and "rng_state" not in best
    for name in ("best.pth", "best-1.pth", "best-2.pth"):
        assert "optimizer" not in load_checkpoint(run_dir / name)
    # The best state is the newest here or an older one: its weights are those of an epoch file of the same step.
    epoch_file = run_dir / f"checkpoint_epoch{best['epoch']}.pth"
    full = load_checkpoint(epoch_file)
    assert full["global_step"] == best["global_step"]
    for key, tensor in full["model_state"].items():
        assert torch.equal(tensor, best["model_state"][key])
    assert (run_dir / "best.pth").stat().st_size < 0.4 * epoch_file.stat().st_size  # AdamW: weights + 2 slots

    weights = read_model_weights(run_dir / "best.pth")  # what predict, evaluate and the hub read
    assert weights.model_args == last["model_args"] and weights.mask_values == last["mask_values"]
    assert weights.inference.scale == 1.0

    # --load starts a new run from it; --resume refuses it in one line that names --load.
    assert runner.main("from-best", "-e", "1", "--load", str(run_dir / "best.pth")) == 0
    assert runner.main("resumed-best", "-e", "1", "--resume", str(run_dir / "best.pth")) == 2
    message = one_error_line(capsys.readouterr().err)
    assert "best.pth cannot be resumed" in message and "--load" in message


BUDGET = re.compile(
    r"a full-state file .* is about ([\d.]+) MB, best.pth \(weights only\) about ([\d.]+) MB; this run keeps at most "
    r"(\d+) full-state and (\d+) weights-only files, about ([\d.]+) MB"
)


def budget(model: torch.nn.Module, optimizer: torch.optim.Optimizer, epochs: range, **flags: int) -> tuple:
    """The figures of the budget line: MB of a full-state and a weights-only file, their counts, MB in all."""
    line = budget_line(model, optimizer, CheckpointSection(**flags), epochs)
    full, weights, full_files, weights_files, total = BUDGET.search(line).groups()
    return float(full), float(weights), int(full_files), int(weights_files), float(total)


def test_budget_arithmetic() -> None:
    model = tiny_unet()
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    adamw = torch.optim.AdamW(model.parameters())
    full = weights + 2 * parameters  # AdamW: two averages per parameter
    # last, INTERRUPTED, 3 of the 5 epoch files (--keep-last 3); best.pth
    expected = (round(full / 1e6, 1), round(weights / 1e6, 1), 5, 1, round((5 * full + weights) / 1e6, 1))
    assert budget(model, adamw, range(1, 6), save_every=1, keep_last=3, keep_best=0) == expected
    assert budget(model, torch.optim.RMSprop(model.parameters(), momentum=0.9), range(1, 2))[0] == round(full / 1e6, 1)
    plain_rmsprop = torch.optim.RMSprop(model.parameters())
    assert budget(model, plain_rmsprop, range(1, 2))[0] == round((weights + parameters) / 1e6, 1)
    # checkpoint_epoch{N}.pth files: every --save_every epochs of those the run trains, the newest --keep-last kept.
    assert budget(model, adamw, range(1, 6), save_every=1, keep_last=0)[2] == 2 + 5
    assert budget(model, adamw, range(1, 6), save_every=2, keep_last=0)[2] == 2 + 2
    assert budget(model, adamw, range(3, 6), save_every=1, keep_last=2)[2] == 2 + 2
    assert budget(model, adamw, range(1, 6), save_every=0, keep_last=0)[2] == 2 + 0
    assert budget(model, adamw, range(1, 6), keep_best=3)[3] == 1 + 3
