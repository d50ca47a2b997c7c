"""Time building a CarvanaDataset over full-size Carvana-style data: first start (scan) and second start (cache).

    .venv/bin/python scripts/measure_dataset_build.py                 # 1000 pairs of 1918x1280
    .venv/bin/python scripts/measure_dataset_build.py --n 200 --workers 4

A few distinct image/mask pairs are drawn with ``utils.synthetic`` and copied under new names up to ``--n``: decoding
cost does not depend on the content, and drawing 1000 full-size scenes would take longer than the measurement. Each
copy is a real file with its own name, size and mtime, so the scan and the cache key see ``--n`` independent files.
Everything lives in a temporary folder (cache included) that is deleted at the end.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

# Run as a plain script from anywhere: make the repository root importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from utils.data_loading import CarvanaDataset  # noqa: E402
from utils.synthetic import generate_carvana_like, parse_size  # noqa: E402


def write_dataset(root: Path, n: int, distinct: int, size: tuple[int, int]) -> tuple[Path, Path]:
    """Draw ``distinct`` pairs, then copy them round-robin until there are ``n``; return the two folders."""
    source = root / "source"
    ids = generate_carvana_like(source, min(distinct, n), size=size, seed=0)
    images_dir, masks_dir = root / "imgs", root / "masks"
    images_dir.mkdir()
    masks_dir.mkdir()
    for index in range(n):
        name = ids[index % len(ids)]
        new_name = f"{index:012x}_{index % 16 + 1:02d}"
        shutil.copyfile(source / "imgs" / f"{name}.jpg", images_dir / f"{new_name}.jpg")
        shutil.copyfile(source / "masks" / f"{name}_mask.gif", masks_dir / f"{new_name}_mask.gif")
    return images_dir, masks_dir


def time_items(dataset: CarvanaDataset, count: int) -> float:
    """Return items per second of ``dataset[i]`` over the first ``count`` items (one process)."""
    count = min(count, len(dataset))
    started = time.perf_counter()
    for index in range(count):
        dataset[index]
    return count / (time.perf_counter() - started)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000, help="image/mask pairs (default 1000)")
    parser.add_argument("--size", default="1918x1280", help="WIDTHxHEIGHT (default Carvana's 1918x1280)")
    parser.add_argument("--distinct", type=int, default=32, help="distinct scenes drawn before copying (default 32)")
    parser.add_argument("--workers", type=int, default=None, help="scan processes (default min(cpu count, 8))")
    parser.add_argument("--items", type=int, default=20, help="items decoded to time __getitem__ (default 20)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    size = parse_size(args.size)

    with tempfile.TemporaryDirectory(prefix="unet-ddp-measure-") as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        images_dir, masks_dir = write_dataset(root, args.n, args.distinct, size)
        print(f"wrote {args.n} pairs of {size[0]}x{size[1]} in {time.perf_counter() - started:.1f} s")

        timings = []
        for attempt in ("first (scan)", "second (cache)"):
            started = time.perf_counter()
            dataset = CarvanaDataset(images_dir, masks_dir, cache_dir=root / "cache", scan_workers=args.workers)
            timings.append(time.perf_counter() - started)
            print(f"{attempt:>15}: {timings[-1]:.3f} s  ({len(dataset)} pairs, mask values {dataset.mask_values})")
        print(f"second start is {timings[0] / timings[1]:.0f}x faster")

        # One thread, as in a DataLoader worker (PyTorch sets that there), so the figure is per worker process.
        torch.set_num_threads(1)
        for scale, augment in ((1.0, False), (0.5, False), (0.5, True)):
            dataset = CarvanaDataset(images_dir, masks_dir, scale, augment=augment, cache_dir=root / "cache")
            rate = time_items(dataset, args.items)
            print(f"__getitem__ at scale {scale}, augment={augment}: {rate:.1f} items/s per worker process")
    return 0


if __name__ == "__main__":
    sys.exit(main())
