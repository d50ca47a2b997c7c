"""Checkpoints sized for what they are for: best.pth and best-K.pth weights-only, the resumable files full-state."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TrainRunner, load_checkpoint
from tests.helpers import one_error_line, tiny_unet
from utils.checkpoint.checkpointer import checkpoint_budget, epoch_files_written, optimizer_slots
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


def test_budget_arithmetic() -> None:
    model = tiny_unet()
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    adamw = torch.optim.AdamW(model.parameters())
    assert optimizer_slots(adamw) == 2
    assert optimizer_slots(torch.optim.RMSprop(model.parameters(), momentum=0.9)) == 2
    assert optimizer_slots(torch.optim.SGD(model.parameters(), lr=0.1)) == 0
    budget = checkpoint_budget(model, adamw, CheckpointSection(save_every=1, keep_last=3, keep_best=0), range(1, 6))
    assert budget.full_state_bytes == weights + 2 * parameters
    assert budget.total_bytes == 5 * budget.full_state_bytes + weights  # last, INTERRUPTED, 3 epoch files; best.pth
    assert epoch_files_written(CheckpointSection(save_every=1, keep_last=0), range(1, 6)) == 5
    assert epoch_files_written(CheckpointSection(save_every=2, keep_last=0), range(1, 6)) == 2
    assert epoch_files_written(CheckpointSection(save_every=1, keep_last=2), range(3, 6)) == 2
    assert epoch_files_written(CheckpointSection(save_every=0, keep_last=0), range(1, 6)) == 0
