"""milesial/Pytorch-UNet's import paths still work and name the very objects this project trains and scores with."""

from __future__ import annotations

import inspect


def test_unet_is_the_model_training_and_inference_build() -> None:
    from unet import UNet, build_model
    from unet.unet_model import UNet as defined
    from utils.checkpoint import model as model_spec
    from utils.training.model import build_architecture as trained

    # Both build through unet.build_model, which gives milesial's UNet for arguments without an encoder.
    assert UNet is defined and trained is build_model is model_spec.build_model
    assert type(build_model({"n_channels": 3, "n_classes": 2, "bilinear": False, "base_channels": 4})) is UNet


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


def _importers_of(module: str) -> list[str]:
    """The project's files (this test's aside) that import ``module`` or a name from it."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    allowed = {root / Path(*module.split(".")).with_suffix(".py"), Path(__file__).resolve()}
    importers = []
    for path in sorted(root.glob("**/*.py")):
        if ".venv" in path.parts or path in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
            if module in names:
                importers.append(str(path.relative_to(root)))
    return importers


def test_data_loading_only_re_exports_and_nothing_in_the_project_imports_through_it() -> None:
    from utils import data_loading
    from utils.datasets import dataset, image_files, mask_values

    homes = {
        "BasicDataset": dataset,
        "CarvanaDataset": dataset,
        "IMAGE_EXTENSIONS": image_files,
        "load_image": image_files,
        "IGNORE_INDEX": mask_values,
        "detect_mask_suffix": image_files,
        "image_tensor": dataset,
        "mask_classes": dataset,
        "scaled_size": dataset,
    }
    assert sorted(data_loading.__all__) == sorted(homes)
    for name, home in homes.items():
        assert getattr(data_loading, name) is getattr(home, name), name
    assert _importers_of("utils.data_loading") == []


def test_dice_score_only_re_exports_the_dice_maths_and_nothing_in_the_project_imports_through_it() -> None:
    from utils import dice_score, evaluation

    for name in dice_score.__all__:
        assert getattr(dice_score, name) is getattr(evaluation, name), name
    assert {"dice_coeff", "dice_loss", "multiclass_dice_coeff"} <= set(dice_score.__all__)
    assert _importers_of("utils.dice_score") == []


# Every import of milesial's own train.py and predict.py (its current master); they must run unchanged against this
# project's modules.
MILESIAL_IMPORTS = {
    "train.py": [
        "from evaluate import evaluate",
        "from unet import UNet",
        "from utils.data_loading import BasicDataset, CarvanaDataset",
        "from utils.dice_score import dice_loss",
    ],
    "predict.py": [
        "from utils.data_loading import BasicDataset",
        "from unet import UNet",
        "from utils.utils import plot_img_and_mask",
    ],
}


def test_every_import_of_milesials_train_and_predict_resolves() -> None:
    for script, statements in MILESIAL_IMPORTS.items():
        for statement in statements:
            namespace: dict = {}
            exec(statement, namespace)  # a fixed import statement, as the script writes it
            names = [name.strip() for name in statement.split(" import ", 1)[1].split(",")]
            assert all(callable(namespace[name]) for name in names), f"{script}: {statement}"


def test_milesials_predict_calls_work_on_our_objects(monkeypatch) -> None:
    """The calls milesial's predict.py makes with what it imports: preprocess, load_state_dict, plot_img_and_mask."""
    import numpy as np
    from PIL import Image

    from unet import UNet
    from utils.data_loading import BasicDataset
    from utils.utils import plot_img_and_mask

    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8))
    prepared = BasicDataset.preprocess(None, image, 0.5, is_mask=False)
    assert prepared.shape == (3, 16, 24) and prepared.dtype == np.float32 and prepared.max() <= 1.0
    # milesial's checkpoints: a state_dict with 'mask_values' beside the weights, popped before loading.
    state_dict = {
        **UNet(n_channels=3, n_classes=2, bilinear=False, base_channels=8).state_dict(),
        "mask_values": [0, 1],
    }
    mask_values = state_dict.pop("mask_values", [0, 1])
    net = UNet(n_channels=3, n_classes=2, bilinear=False, base_channels=8)
    net.load_state_dict(state_dict)
    assert mask_values == [0, 1] and (net.n_channels, net.n_classes) == (3, 2)

    # --viz on a machine without a display: a figure on the Agg canvas, returned, no window and no error.
    import matplotlib.pyplot as plt

    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    monkeypatch.delenv("MPLBACKEND", raising=False)
    open_figures = plt.get_fignums()
    classes = np.zeros((32, 48), dtype=np.int64)
    classes[8:20, 10:30] = 1
    figure = plot_img_and_mask(image, classes)  # current predict_img: class indices
    assert [axes.get_title() for axes in figure.axes] == ["Input image", "Mask (class 0)", "Mask (class 1)"]
    assert (figure.axes[2].images[0].get_array() == (classes == 1)).all()
    planes = np.stack([classes == 0, classes == 1, np.zeros_like(classes, dtype=bool)])
    assert len(plot_img_and_mask(image, planes).axes) == 4  # older predict_img: one plane per class
    assert plt.get_fignums() == open_figures
    figure.canvas.draw()  # drawable headless
