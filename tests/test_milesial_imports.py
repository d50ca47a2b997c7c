"""milesial/Pytorch-UNet's import paths still work and name the very objects this project trains and scores with."""

from __future__ import annotations

import inspect


def test_unet_is_the_model_training_and_inference_build() -> None:
    from unet import UNet
    from unet.unet_model import UNet as defined
    from utils import model_spec
    from utils.training.build_model import UNet as trained

    assert UNet is defined is trained is model_spec.UNet


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


def test_data_loading_only_re_exports_and_nothing_in_the_project_imports_through_it() -> None:
    import ast
    from pathlib import Path

    from utils import data_loading
    from utils.datasets import dataset, image_files, mask_values, pairing, preparation

    homes = {
        "BasicDataset": dataset,
        "CarvanaDataset": dataset,
        "IMAGE_EXTENSIONS": image_files,
        "load_image": image_files,
        "IGNORE_INDEX": mask_values,
        "detect_mask_suffix": pairing,
        "image_tensor": preparation,
        "mask_classes": preparation,
        "scaled_size": preparation,
    }
    assert sorted(data_loading.__all__) == sorted(homes)
    for name, home in homes.items():
        assert getattr(data_loading, name) is getattr(home, name), name

    root = Path(__file__).resolve().parents[1]
    allowed = {root / "utils" / "data_loading.py", Path(__file__).resolve()}
    importers = []
    for path in sorted(root.glob("**/*.py")):
        if ".venv" in path.parts or path in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
            if "utils.data_loading" in names:
                importers.append(str(path.relative_to(root)))
    assert importers == []
