"""Tests for ``python -m utils.datasets.check`` on real Carvana-style folders (several views per car)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.conftest import REPO_ROOT, child_env
from utils.datasets import mask_values
from utils.datasets.check import CheckSettings, check_dataset, main
from utils.datasets.synthetic import generate_carvana_like

SIZE = (48, 32)


def make_cars(root: Path, cars: int = 6, views: int = 4) -> list[str]:
    return generate_carvana_like(root, cars * views, size=SIZE, seed=3, views=views)


def copy_pair(root: Path, source: str, target: str) -> None:
    shutil.copyfile(root / "imgs" / f"{source}.jpg", root / "imgs" / f"{target}.jpg")
    shutil.copyfile(root / "masks" / f"{source}_mask.gif", root / "masks" / f"{target}_mask.gif")


def run_check(root: Path, tmp_path: Path, *extra: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    args = ["--imgs", str(root / "imgs"), "--masks", str(root / "masks"), "--cache-dir", str(tmp_path / "cache")]
    code = main([*args, *extra])
    return code, capsys.readouterr().out.splitlines()


def test_clean_data_passes_and_the_second_check_reads_the_mask_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "data"
    ids = make_cars(root)
    assert len({image_id.rpartition("_")[0] for image_id in ids}) == 6 and ids[3].endswith("_04")  # 4 views per car
    code, lines = run_check(root, tmp_path, "--classes", "1", "--workers", "1", capsys=capsys)
    assert code == 0, lines
    assert lines[0].startswith("24 images in") and lines[-1] == "OK: training would start on this data"
    assert any(line.startswith("mask values [0, 1]; pixels per class: 0: ") for line in lines)
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1

    def no_decoding(pair: object) -> object:
        raise AssertionError("the second check decoded a mask")

    monkeypatch.setattr(mask_values, "_scan_pair", no_decoding)
    report = check_dataset(
        CheckSettings(imgs=root / "imgs", masks=root / "masks", classes=1, workers=1, cache_dir=tmp_path / "cache")
    )
    assert report.passes(strict=True) and report.summary[1].startswith("mask values [0, 1]; pixels per class: 0: ")
    shares = [float(share) for share in re.findall(r"\d: ([\d.]+)%", report.summary[1])]
    assert len(shares) == 2 and sum(shares) == pytest.approx(100, abs=0.01) and 0 < shares[1] < 60


def test_every_kind_of_problem_gets_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "data"
    ids = make_cars(root)
    (root / "masks" / f"{ids[0]}_mask.gif").unlink()  # an image without a mask
    shutil.copyfile(root / "masks" / f"{ids[1]}_mask.gif", root / "masks" / "orphan_01_mask.gif")
    (root / "imgs" / f"{ids[2]}.jpg").write_bytes(b"not a photo")  # unreadable
    Image.new("P", (SIZE[0] + 2, SIZE[1])).save(root / "masks" / f"{ids[3]}_mask.gif")  # wrong size
    exif = Image.Exif()
    exif[0x0112] = 3  # "rotate 180 degrees to display": upright it keeps its size, so only the warning
    Image.open(root / "imgs" / f"{ids[4]}.jpg").convert("RGB").save(root / "imgs" / f"{ids[4]}.jpg", exif=exif)

    code, lines = run_check(root, tmp_path, "--classes", "1", capsys=capsys)

    assert code == 1
    problems = [line for line in lines if line.startswith("problem: ")]
    assert [line.split(":")[1].strip() for line in problems] == ["pairing", "unreadable files", "size mismatches"]
    assert f"{ids[0]}.jpg" in problems[0] and f"{ids[2]}.jpg" in problems[1] and f"{ids[3]}_mask.gif" in problems[2]
    assert any(line.startswith("warning: pairing: 1 mask(s) in ") and "have no image in" in line for line in lines)
    assert any(line.startswith("warning: EXIF rotation: 1 photo") and f"{ids[4]}.jpg" in line for line in lines)
    assert not any(line.startswith("OK") for line in lines)


def test_too_many_mask_values_for_classes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "data"
    ids = make_cars(root, cars=2, views=2)
    mask = Image.open(root / "masks" / f"{ids[0]}_mask.gif")
    mask.putpixel((0, 0), 2)  # a third palette index (GIF renumbers unused high indices)
    mask.save(root / "masks" / f"{ids[0]}_mask.gif")
    code, lines = run_check(root, tmp_path, "--classes", "1", capsys=capsys)
    assert code == 1
    # The dataset's own message (utils.datasets.mask_values.class_value_findings): training would stop on it.
    assert any(
        line.startswith("problem: mask values: the masks in ")
        and "contain 3 distinct values (0, 1, 2) but n_classes=1 allows at most 2" in line
        for line in lines
    ), lines
    code, lines = run_check(root, tmp_path, "--classes", "1", "--ignore-value", "2", capsys=capsys)
    assert code == 0 and any(line.startswith("void (--ignore-value): ") for line in lines)


def test_void_values_on_colour_masks_and_jpeg_masks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """As the dataset: --ignore-value needs single-channel masks (the check used to say OK), JPEG masks warn."""
    root = tmp_path / "data"
    ids = make_cars(root, cars=2, views=2)
    for image_id in ids:
        mask = root / "masks" / f"{image_id}_mask.gif"
        Image.open(mask).convert("RGB").save(mask.with_suffix(".png"))
        mask.unlink()
    code, lines = run_check(root, tmp_path, "--ignore-value", "255", capsys=capsys)
    assert code == 1 and not any(line.startswith("OK") for line in lines)
    assert any(
        line.startswith("problem: mask values: --ignore-value 255 needs single-channel masks") for line in lines
    ), lines
    assert run_check(root, tmp_path, capsys=capsys)[0] == 0
    for image_id in ids:
        mask = root / "masks" / f"{image_id}_mask.png"
        Image.open(mask).convert("L").save(mask.with_suffix(".jpg"), quality=100)
        mask.unlink()
    code, lines = run_check(root, tmp_path, "--strict", capsys=capsys)
    assert code == 1 and any(line.startswith("problem: JPEG masks: 4 mask(s) in ") for line in lines), lines


def test_duplicates_and_the_ones_that_cross_the_split(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "data"
    ids = make_cars(root, cars=6, views=2)
    # Copies named as more views of the same car: --split-by prefix keeps each copy beside its original.
    for view, source in enumerate(ids[:6]):
        copy_pair(root, source, f"{source.rpartition('_')[0]}_{90 + view}")

    code, lines = run_check(root, tmp_path, "--split-by", "image", "--validation", "50", capsys=capsys)
    assert code == 0  # duplicates do not stop training
    assert any(line.startswith("warning: duplicates: 6 photos are exact copies of others (6 groups") for line in lines)
    crossing = [line for line in lines if line.startswith("warning: duplicates across the split")]
    assert len(crossing) == 1 and "under --split-by image" in crossing[0]

    code, lines = run_check(root, tmp_path, "--split-by", "prefix", "--validation", "50", capsys=capsys)
    assert code == 0 and not any("across the split" in line for line in lines)

    code, lines = run_check(root, tmp_path, "--split-by", "image", "--validation", "50", "--strict", capsys=capsys)
    assert code == 1 and any(line.startswith("problem: duplicates across the split") for line in lines)


def test_one_copy_is_one_photo_and_a_prefix_split_is_not_told_to_use_itself(tmp_path: Path, capsys) -> None:
    root = tmp_path / "data"
    ids = make_cars(root, cars=6, views=2)
    copy_pair(root, ids[0], "othercar_01")  # a copy under another prefix: --split-by prefix cannot keep it beside
    code, lines = run_check(root, tmp_path, "--split-by", "prefix", "--validation", "50", capsys=capsys)
    assert code == 0
    assert any(line.startswith("warning: duplicates: 1 photo is an exact copy of another (1 group ") for line in lines)
    # Copies of other cars under prefixes of their own: some land on the other side of the prefix split.
    for car in range(1, 6):
        copy_pair(root, ids[2 * car], f"othercar{car}_01")
    code, lines = run_check(root, tmp_path, "--split-by", "prefix", "--validation", "50", capsys=capsys)
    crossing = [line for line in lines if line.startswith("warning: duplicates across the split")]
    assert len(crossing) == 1 and "with a --group-pattern" in crossing[0], lines
    assert "--split-by prefix /" not in crossing[0]


def test_bad_flags_and_missing_folders_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--imgs", str(tmp_path / "nowhere"), "--masks", str(tmp_path / "nowhere")]
    assert main(args) == 2
    assert capsys.readouterr().err.startswith("Error: image folder")
    root = tmp_path / "data"
    make_cars(root, cars=2, views=2)
    code, _ = run_check(root, tmp_path, "--split-by", "image", "--folds", "3", "--fold", "3", capsys=capsys)
    assert code == 2
    # As training: one folder for both would pair every image with itself.
    assert main(["--imgs", str(root / "imgs"), "--masks", str(root / "imgs"), "--cache-dir", str(tmp_path)]) == 2
    assert "are one folder; give the masks their own folder" in capsys.readouterr().err


@pytest.mark.slow
def test_command_line_with_a_process_pool(tmp_path: Path) -> None:
    """As users run it: a real process, enough files for the reader pool, and the second run from the cache."""
    root = tmp_path / "data"
    make_cars(root, cars=10, views=4)
    folders = ["--imgs", str(root / "imgs"), "--masks", str(root / "masks"), "--cache-dir", str(tmp_path / "cache")]
    command = [sys.executable, "-m", "utils.datasets.check", *folders, "--workers", "2", "--split-by", "prefix"]
    for _ in range(2):
        done = subprocess.run(command, cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[-1] == "OK: training would start on this data"
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--classes", "0"], "Error: --classes must be at least 1, got 0"),
        (["--workers", "0"], "Error: --workers must be at least 1, got 0"),
        (["--validation", "100"], "Error: --validation must be a finite number in (0, 100), got 100"),
        (["--split-by", "prefix", "--fold", "-1"], "Error: --fold must be at least 0, got -1"),  # train.py's flag
    ],
)
def test_out_of_range_flags_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    """The ranges are the flags' own, as train.py declares them: checked once by the parser, before any file is read."""
    assert main(["--imgs", str(tmp_path / "nowhere"), "--masks", str(tmp_path / "nowhere"), *flags]) == 2
    assert capsys.readouterr().err.strip() == message


def test_the_check_imports_no_torch() -> None:
    """Its workers start fast: the flags it shares with train.py (``SplitFlags``) and its error line
    (``utils.cli.print_error``) come from modules that import no torch either."""
    code = "import sys, utils.datasets.check; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
