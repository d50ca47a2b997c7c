"""Tiled vs whole-image prediction, with and without --tta: agreement and Dice, measured through predict.py itself.

    python -m utils.datasets.synthetic /tmp/carvana --n 8 --size 1918x1280 --seed 1
    python scripts/measure_tiling.py -m checkpoints/demo/best.pth --imgs /tmp/carvana/imgs --masks /tmp/carvana/masks \
        --tile 128 256

For each setting (whole image, each --tile, each with and without --tta) predict.py writes masks into a temporary
folder; this script then reports the share of pixels equal to the whole-image masks and the mean foreground Dice
against the true masks (class = index of the mask value, per image, then averaged, as evaluate.py does).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import predict  # noqa: E402
from utils.datasets.mask_values import mask_array  # noqa: E402
from utils.inference.writer import find_truth_mask  # noqa: E402


def _dice(predicted: np.ndarray, truth: np.ndarray) -> float:
    both = np.logical_and(predicted, truth).sum()
    total = predicted.sum() + truth.sum()
    return 1.0 if total == 0 else 2.0 * both / total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--imgs", required=True, type=Path)
    parser.add_argument("--masks", required=True, type=Path)
    parser.add_argument("--tile", type=int, nargs="+", default=[128, 256])
    args = parser.parse_args()
    images = sorted(path for path in args.imgs.iterdir() if not path.name.startswith("."))
    settings = [("whole", [])] + [(f"tile {size}", ["--tile", str(size)]) for size in args.tile]
    results: dict[str, dict[str, np.ndarray]] = {}
    with tempfile.TemporaryDirectory() as out:
        for name, extra in settings:
            for tta in (False, True):
                label = f"{name}{' + tta' if tta else ''}"
                folder = Path(out) / label.replace(" ", "_")
                argv = ["-m", args.model, "-i", *map(str, images), "--output-dir", str(folder), "--no-progress"]
                if predict.main([*argv, *extra, *(["--tta"] if tta else [])]) != 0:
                    return 1
                results[label] = {p.stem: np.asarray(Image.open(folder / f"{p.stem}_OUT.png")) > 0 for p in images}
    truths = {}
    for path in images:
        truth_path = find_truth_mask(args.masks, path)
        assert truth_path is not None, path
        truths[path.stem] = mask_array(Image.open(truth_path)) > 0
    print(f"{len(images)} images of {args.imgs}, model {args.model}")
    print(f"{'setting':<18} {'agreement with whole':>20} {'Dice':>8}")
    for label, masks in results.items():
        agreement = np.mean([(masks[stem] == results["whole"][stem]).mean() for stem in masks])
        dice = np.mean([_dice(masks[stem], truths[stem]) for stem in masks])
        print(f"{label:<18} {agreement:>19.4%} {dice:>8.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
