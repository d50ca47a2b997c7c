"""PIL's decompression-bomb limit (``Image.MAX_IMAGE_PIXELS``): an image above it is one ``Error:`` line naming the
file and the limit in training and evaluate, one failed file in predict, and read whole by predict.py ``--tile``.

The limit is lowered in-process (monkeypatch), so that a small real PNG is "too large"; PIL's own behaviour (a warning
up to twice the limit, an error above) is covered on both sides.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

import evaluate
import predict
from tests.conftest import SyntheticData, TrainRunner
from tests.helpers import make_model, one_error_line, save_checkpoint_trained_at, write_images
from utils.datasets.image_files import image_header, load_image
from utils.errors import DatasetError

# write_images' 64x48 image: 3,072 pixels.
PIXELS = 64 * 48


@pytest.fixture
def big_png(tmp_path: Path) -> Path:
    return write_images(tmp_path / "imgs", [(64, 48)])[0]


@pytest.mark.parametrize("limit", [PIXELS - 1, PIXELS // 2 - 1], ids=["PIL-warns", "PIL-raises"])
def test_an_image_above_the_limit_is_refused_by_name(
    big_png: Path, limit: int, monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
    with pytest.raises(DatasetError, match=rf"{big_png}.* 64x48 = 3,072 pixels.* limit of {limit:,}.*--tile"):
        load_image(big_png)
    assert Image.MAX_IMAGE_PIXELS == limit  # set aside while opening, then restored
    assert not [w for w in recwarn if issubclass(w.category, Image.DecompressionBombWarning)]  # no second message


def test_at_the_limit_and_with_any_size_the_image_loads(big_png: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", PIXELS)
    with load_image(big_png) as image:
        assert image.size == (64, 48)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with load_image(big_png, any_size=True) as image:
        assert image.convert("RGB").size == (64, 48)  # decoded, not only its header
    assert image_header(big_png) == (64, 48, 3)  # a header read is no bomb
    assert Image.MAX_IMAGE_PIXELS == 100


def test_training_stops_with_one_line_naming_the_file_and_the_limit(
    runner: TrainRunner, carvana_data: SyntheticData, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # carvana_data's 48x32 images and masks: 1,536 pixels
    code = runner.main("bomb", "--epochs", "1", "--num-workers", "0")
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    line = one_error_line(err)
    assert "48x32 = 1,536 pixels" in line and "limit of 1,000" in line, line
    assert str(carvana_data.imgs) in line or str(carvana_data.masks) in line, line


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return save_checkpoint_trained_at(tmp_path / "model.pth", make_model(), scale=1.0)


def test_evaluate_stops_with_one_line(
    big_png: Path, checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    masks = tmp_path / "masks"
    masks.mkdir()
    Image.new("L", (64, 48)).save(masks / big_png.name)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    code = evaluate.main(["-m", str(checkpoint), "--imgs", str(big_png.parent), "--masks", str(masks),
                          "--no-progress", "-j", "0"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    line = one_error_line(err)
    assert "64x48 = 3,072 pixels" in line and "limit of 1,000" in line, line


def test_predict_fails_the_file_and_reads_it_whole_with_tile(
    big_png: Path, checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    common = ["-m", str(checkpoint), "-i", str(big_png), "-s", "1", "--no-progress", "-j", "0"]
    assert predict.main([*common, "--output-dir", str(tmp_path / "whole")]) == predict.PARTIAL_FAILURE_EXIT_CODE
    assert f"{big_png} has 64x48 = 3,072 pixels" in caplog.text
    assert not list((tmp_path / "whole").glob("*.png"))
    assert predict.main([*common, "--output-dir", str(tmp_path / "tiled"), "--tile", "32"]) == 0
    assert Image.MAX_IMAGE_PIXELS == 1000  # --tile went past the limit without changing it for others
    with load_image(tmp_path / "tiled" / f"{big_png.stem}_OUT.png", any_size=True) as mask:
        assert mask.size == (64, 48)
