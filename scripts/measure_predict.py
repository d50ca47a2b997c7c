"""Throughput of predict.py (images/s) for several batch sizes and precisions.

    .venv/bin/python scripts/measure_predict.py                       # 64 images of 480x320, batch 1 and 8, fp32/bf16
    .venv/bin/python scripts/measure_predict.py --device cuda --precisions fp32 bf16 fp16 --budget-s 120

Runs predict.py's whole pipeline in-process (decoding in loader workers, forward pass, logits resized to the
original size, PNG writing in writer threads) over Carvana-like JPEGs from ``utils.synthetic``, with an untrained
``base_channels=64`` UNet: speed does not depend on the weights. Timing starts after the model is built and one
warm-up batch has run, so it measures the steady state, not start-up.

Each configuration has a time budget (``--budget-s``): a first batch estimates its speed and the measurement then
uses as many of the ``--n-images`` images as fit in the budget (whole batches). The table says how many images each
figure is based on; where one batch would not fit, the figure is the single-image probe's (start-up costs included,
so a lower bound). On a shared
machine the figures are noisy: run it twice and compare.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

# Run as a plain script from anywhere: make the repository root importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import predict  # noqa: E402
from unet import UNet  # noqa: E402
from utils.inference import PRECISIONS  # noqa: E402
from utils.synthetic import generate_carvana_like, parse_size  # noqa: E402


def time_run(model: UNet, config: predict.PredictConfig, images: list[Path]) -> float:
    """Seconds predict.py takes to predict and write ``images`` (the model is already loaded)."""
    device = torch.device(config.device)
    started = time.perf_counter()
    status = predict.predict_files(model, [0, 1], replace(config, inputs=[str(path) for path in images]), device)
    elapsed = time.perf_counter() - started
    if status != 0:
        raise RuntimeError(f"predict.py failed with status {status}")
    return elapsed


def measure(
    model: UNet, config: predict.PredictConfig, images: list[Path], budget_s: float, probes: dict[str, float]
) -> tuple[float | None, int, str]:
    """Images per second of ``config`` within ``budget_s``; returns (rate, images measured, note).

    ``probes`` caches the seconds one image took alone, per precision, so a slow precision is probed only once.
    """
    batch = config.batch_size
    if len(images) < batch:
        return None, 0, f"needs at least {batch} images"
    if config.precision not in probes:
        # One image alone (one-off costs included) tells whether a batch can fit in the budget at all.
        probes[config.precision] = time_run(model, replace(config, batch_size=1), images[:1])
    probe_s = probes[config.precision]
    if probe_s * batch > budget_s:
        return 1 / probe_s, 1, f"estimate from 1 image: a batch of {batch} would exceed the {budget_s:.0f} s budget"
    # A first batch pays the remaining one-off costs (kernel selection per shape, worker start-up).
    warmup_s = time_run(model, config, images[:batch])
    affordable = int(budget_s / warmup_s * batch) // batch * batch
    count = max(batch, min(len(images), affordable))
    elapsed = time_run(model, config, images[:count])
    note = "" if count == len(images) else f"budget: {count} of {len(images)} images"
    return count / elapsed, count, note


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-images", type=int, default=64, help="images to predict per configuration (64)")
    parser.add_argument("--size", default="480x320", help="WIDTHxHEIGHT of the images (480x320)")
    parser.add_argument("--scale", type=float, default=0.5, help="predict.py --scale (0.5)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="batch sizes (1 8)")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=sorted(PRECISIONS))
    parser.add_argument("--device", default="cpu", help="cpu, cuda, ... (cpu)")
    parser.add_argument("--workers", type=int, default=2, help="predict.py --workers (2)")
    parser.add_argument("--base-channels", type=int, default=64, help="UNet width (64, the classic model)")
    parser.add_argument("--budget-s", type=float, default=60.0, help="time budget per configuration in s (60)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")

    with tempfile.TemporaryDirectory(prefix="measure_predict_") as tmp:
        root = Path(tmp)
        generate_carvana_like(root / "data", args.n_images, size=parse_size(args.size), seed=0)
        images = sorted((root / "data" / "imgs").iterdir())
        torch.manual_seed(0)
        model = UNet(3, 2, base_channels=args.base_channels).eval()
        base = predict.PredictConfig(
            output_dir=root / "out", scale=args.scale, device=args.device, workers=args.workers,
            progress=False,
        )  # fmt: skip
        print(f"predict.py on {args.n_images} images of {args.size} (--scale {args.scale}), UNet base_channels="
              f"{args.base_channels}, device {args.device}, {torch.get_num_threads()} torch threads, "
              f"torch {torch.__version__}")  # fmt: skip
        print(f"{'precision':<10} {'batch':>5} {'images/s':>9} {'images':>6}  note")
        probes: dict[str, float] = {}
        for precision in args.precisions:
            for batch_size in args.batch_sizes:
                config = replace(base, precision=precision, batch_size=batch_size)
                rate, count, note = measure(model, config, images, args.budget_s, probes)
                shown = f"{rate:9.2f}" if rate is not None else f"{'-':>9}"
                print(f"{precision:<10} {batch_size:>5} {shown} {count:>6}  {note}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
