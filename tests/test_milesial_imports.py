"""milesial/Pytorch-UNet's import paths still work and name the very objects this project trains and scores with."""

from __future__ import annotations

import inspect


def test_unet_is_the_model_training_and_inference_build() -> None:
    from unet import UNet
    from unet.unet_model import UNet as defined
    from utils import model_spec
    from utils.training import setup

    assert UNet is defined is setup.UNet is model_spec.UNet


def test_datasets_are_the_ones_training_loads() -> None:
    from utils.data_loading import BasicDataset, CarvanaDataset
    from utils.training import data

    assert data.BasicDataset is BasicDataset
    assert issubclass(CarvanaDataset, BasicDataset)
    assert list(inspect.signature(BasicDataset).parameters)[:3] == ["images_dir", "mask_dir", "scale"]


def test_dice_functions_are_the_ones_the_loss_uses() -> None:
    from utils.dice_score import dice_coeff, dice_loss, multiclass_dice_coeff
    from utils.training import objective

    assert objective.dice_coeff is dice_coeff and objective.multiclass_dice_coeff is multiclass_dice_coeff
    assert list(inspect.signature(dice_loss).parameters) == ["input", "target", "multiclass"]


def test_evaluate_script_re_exports_the_scorer() -> None:
    import evaluate
    from utils.evaluation import evaluate as scorer

    assert evaluate.evaluate is scorer
