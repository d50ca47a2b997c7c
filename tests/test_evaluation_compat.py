"""utils.evaluation.evaluate keeps milesial/Pytorch-UNet's and the DDP script's call forms; the rich result too."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers import make_model, tiny_unet
from utils.datasets.dataset import CarvanaDataset
from utils.evaluation import EvalResult, evaluate, evaluate_segmentation


@pytest.fixture
def val_loader(carvana_data) -> DataLoader:
    # milesial's loader: batches are dicts with "image" and "mask".
    return DataLoader(CarvanaDataset(carvana_data.imgs, carvana_data.masks, 0.5), batch_size=4, shuffle=False)


@pytest.mark.parametrize("n_classes", [1, 2])
def test_milesial_call_returns_the_mean_dice_as_a_float(val_loader, n_classes):
    net = make_model(n_classes)  # output bias balanced: a real, non-zero Dice
    dice = evaluate(net, val_loader, torch.device("cpu"), False)
    rich = evaluate_segmentation(net, val_loader, torch.device("cpu"), n_classes=n_classes, progress=False)
    assert isinstance(dice, float) and isinstance(rich, EvalResult)
    assert dice == pytest.approx(rich.dice, abs=1e-9)
    assert 0.0 < dice < 1.0


def test_ddp_script_call_with_disable_log_and_a_wrapped_model(val_loader, capsys):
    net = tiny_unet()

    class Wrapper(torch.nn.Module):  # what DistributedDataParallel looks like to evaluate: the model is .module
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    dice = evaluate(Wrapper(net), val_loader, "cpu", disable_log=True)
    assert "Validation" not in capsys.readouterr().err
    assert dice == pytest.approx(evaluate(net, val_loader, torch.device("cpu")), abs=1e-9)
    assert "Validation" in capsys.readouterr().err  # the control: without disable_log there is a bar


def test_amp_runs_in_bf16_on_the_cpu_and_agrees_roughly(val_loader):
    net = tiny_unet()
    assert evaluate(net, val_loader, torch.device("cpu"), True) == pytest.approx(
        evaluate(net, val_loader, torch.device("cpu"), False), abs=0.05
    )
