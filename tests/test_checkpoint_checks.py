"""A checkpoint is checked against itself before anything is built from it (utils/checkpoint/model.py)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import REPO_ROOT, SyntheticData, child_env
from tests.helpers import checkpoint_payload, one_error_line, tiny_unet
from utils.checkpoint.files import save_checkpoint_atomic
from utils.checkpoint.format import KEY_MASK_VALUES, KEY_MODEL, KEY_MODEL_ARGS, KEY_TENSOR_DIGESTS
from utils.checkpoint.model import load_model


def _crafted(path: Path, edit: Callable[[dict[str, Any]], None], *, digests: bool = True) -> Path:
    payload = checkpoint_payload(tiny_unet(), [0, 1])
    edit(payload)
    if digests:
        save_checkpoint_atomic(payload, path)  # the digests match the edited tensors: only the new checks see it
    else:
        torch.save(payload, path)
    return path


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda payload: payload.__setitem__(key, value)


def _integer_weights(payload: dict[str, Any]) -> None:
    payload[KEY_MODEL] = {key: tensor.round().to(torch.int64) for key, tensor in payload[KEY_MODEL].items()}


def _negative_variance(payload: dict[str, Any]) -> None:
    payload[KEY_MODEL]["inc.double_conv.1.running_var"][0] = -1.0


CASES = [
    (
        "base_channels",
        _set(KEY_MODEL_ARGS, {"n_channels": 3, "n_classes": 2, "bilinear": False, "base_channels": 1024}),
        "its model_args",
    ),  # fmt: skip
    (
        "n_classes",
        _set(KEY_MODEL_ARGS, {"n_channels": 3, "n_classes": 5, "bilinear": False, "base_channels": 8}),
        "do not describe its weights",
    ),  # fmt: skip
    ("duplicated values", _set(KEY_MASK_VALUES, [0, 0]), "repeat a value"),
    ("more values than classes", _set(KEY_MASK_VALUES, [0, 1, 2]), "name 3 values but the model predicts 2"),
    ("string values", _set(KEY_MASK_VALUES, ["car", "road"]), "hold 'car', not an integer"),
    ("negative value", _set(KEY_MASK_VALUES, [-1, 1]), "hold -1, not an integer"),
    ("integer weights", _integer_weights, "as torch.int64, not floating point"),
    ("negative variance", _negative_variance, "negative BatchNorm variance in inc.double_conv.1.running_var"),
]


@pytest.mark.parametrize(("name", "edit", "expected"), CASES, ids=[case[0] for case in CASES])
def test_predict_refuses_a_checkpoint_that_contradicts_itself(
    name: str, edit: Callable, expected: str, carvana_data: SyntheticData, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import predict

    checkpoint = _crafted(tmp_path / "crafted.pth", edit)
    out = tmp_path / "out"
    code = predict.main(["-m", str(checkpoint), "-i", str(carvana_data.imgs), "--output-dir", str(out), "-j", "0",
                         "--no-progress"])  # fmt: skip
    assert code == 2
    error = one_error_line(capsys.readouterr().err)
    assert expected in error and str(checkpoint) in error, error
    assert not out.exists() or not any(out.iterdir())


def test_the_unedited_file_loads(tmp_path: Path) -> None:
    """Control: the same file without an edit passes every check."""
    model, spec = load_model(_crafted(tmp_path / "plain.pth", lambda payload: None))
    assert spec.base_channels == 8 and spec.mask_values == [0, 1]
    colours = _crafted(tmp_path / "colours.pth", _set(KEY_MASK_VALUES, [[0, 0, 0], [255, 0, 0]]))
    assert load_model(colours)[1].mask_values == [[0, 0, 0], [255, 0, 0]]
    milesial_bits = _crafted(tmp_path / "bits.pth", _set(KEY_MASK_VALUES, [False, True]))
    assert load_model(milesial_bits)[1].mask_values == [False, True]


PLAIN_ARGS = {"n_channels": 3, "n_classes": 2, "bilinear": False, "base_channels": 8}
ARGS_CASES = [
    ({**PLAIN_ARGS, "n_classes": True}, r"model_args n_classes=True is not of type int"),
    ({**PLAIN_ARGS, "bilinear": "no"}, r"model_args bilinear='no' is not of type bool"),
    ({**PLAIN_ARGS, "depth": 5}, r"model_args has unknown keys \['depth'\]"),
    ({"n_channels": 3, "n_classes": 2, "bilinear": False}, r"model_args has missing keys \['base_channels'\]"),
    ({**PLAIN_ARGS, "base_channels": 0}, r"describe no model \(UNet needs positive sizes"),
    ({**PLAIN_ARGS, "encoder": "vgg"}, r"describe no model \(.*its encoder is one of resnet18, resnet34, resnet50"),
    ({**PLAIN_ARGS, "encoder": "resnet18", "bilinear": True}, r"bilinear upsampling, which only the unet encoder has"),
    ([3, 2], r"model_args is a list, not a mapping"),
]


@pytest.mark.parametrize(("args", "expected"), ARGS_CASES)
def test_model_args_that_build_no_model_are_refused_before_anything_is_built(tmp_path: Path, args, expected) -> None:
    from utils.errors import CheckpointError

    with pytest.raises(CheckpointError, match=expected):
        load_model(_crafted(tmp_path / "args.pth", _set(KEY_MODEL_ARGS, args)))


def test_our_format_without_its_digests_is_refused(tmp_path: Path) -> None:
    from utils.errors import CheckpointError

    stripped = _crafted(tmp_path / "stripped.pth", lambda payload: None, digests=False)
    assert KEY_TENSOR_DIGESTS not in torch.load(stripped, weights_only=True)
    with pytest.raises(CheckpointError, match=r"its tensor digests \(tensor_sha256\) were removed"):
        load_model(stripped)
    # The documented way out: the weights alone load as a foreign file (verified for NaN/inf only, as milesial's).
    torch.save(torch.load(stripped, weights_only=True)[KEY_MODEL], tmp_path / "weights.pth")
    assert load_model(tmp_path / "weights.pth")[1].base_channels == 8


def test_mask_values_beyond_16_bits_are_refused_by_predict_only(
    carvana_data: SyntheticData, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    import evaluate
    import predict

    checkpoint = _crafted(tmp_path / "wide.pth", _set(KEY_MASK_VALUES, [0, 70000]))
    code = predict.main(["-m", str(checkpoint), "-i", str(carvana_data.imgs), "--output-dir", str(tmp_path / "out"),
                         "-j", "0", "--no-progress"])  # fmt: skip
    assert code == 2
    assert "mask value 70000 does not fit a 16-bit PNG mask" in one_error_line(capsys.readouterr().err)
    # Scoring needs no image of the values: evaluate runs (the true masks hold 0/1, which this model does not know,
    # so it refuses them for their own reason, not for the model's values).
    code = evaluate.main(["-m", str(checkpoint), "--imgs", str(carvana_data.imgs), "--masks", str(carvana_data.masks),
                          "-j", "0", "--no-progress"])  # fmt: skip
    assert "16-bit" not in capsys.readouterr().err


def test_a_lying_base_channels_is_refused_before_the_model_is_built(tmp_path: Path) -> None:
    """Memory, not time: a model of base_channels 256 (2 GB of weights) is never allocated."""
    liar = {"n_channels": 3, "n_classes": 2, "bilinear": False, "base_channels": 256}
    checkpoint = _crafted(tmp_path / "liar.pth", _set(KEY_MODEL_ARGS, liar))
    probe = (
        "import resource, sys; from utils.checkpoint.model import load_model\n"
        "try:\n    load_model(sys.argv[1])\nexcept Exception as error:\n    print(type(error).__name__, error)\n"
        "print('peak_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe, str(checkpoint)], cwd=REPO_ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert "CheckpointError" in done.stdout and "contradicts itself" in done.stdout, done.stdout + done.stderr
    peak_kib = int(done.stdout.split("peak_kib")[1])
    assert peak_kib < 1_500_000, f"peak memory {peak_kib} KiB: the 2 GB model was built"
