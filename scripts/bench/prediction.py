"""The predict section: ``predict.py``'s images/s per precision and batch size (one warm-up call, then a timed one).

It replaces the former ``scripts/measure_predict.py``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from scripts.bench.context import Context
from scripts.bench.demo_data import ensure_demo_data
from scripts.bench.processes import MeasurementError, call_worker
from scripts.bench.timing import cuda_max_allocated_mib


def run_predict(ctx: Context) -> dict[str, Any]:
    from unet import UNet
    from utils.checkpoint.files import save_checkpoint_atomic
    from utils.checkpoint.format import FORMAT_VERSION, KEY_FORMAT_VERSION, KEY_MASK_VALUES, KEY_MODEL, KEY_MODEL_ARGS

    config = ctx.config
    demo = ensure_demo_data(ctx)
    inputs = sorted(str(p) for p in (demo / "imgs").iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
    count = max(config.predict_images, max(config.predict_batch_sizes))
    if len(inputs) < count:
        raise MeasurementError(f"{demo / 'imgs'} has {len(inputs)} images; predict needs {count}")
    inputs = inputs[:count]
    torch.manual_seed(0)
    model_args = {"n_channels": 3, "n_classes": config.classes, "bilinear": False}
    model = UNet(**model_args, base_channels=config.base_channels)
    checkpoint = ctx.work_dir / "predict-model.pth"
    save_checkpoint_atomic(
        {
            KEY_FORMAT_VERSION: FORMAT_VERSION,
            KEY_MODEL: model.state_dict(),
            KEY_MODEL_ARGS: model.constructor_args(),
            KEY_MASK_VALUES: list(range(max(config.classes, 2))),
        },
        checkpoint,
    )
    out: list[dict[str, Any]] = []
    for precision in config.precisions:
        for batch in config.predict_batch_sizes:
            output_dir = ctx.work_dir / "predictions" / f"{precision}-b{batch}"
            spec = {
                "checkpoint": str(checkpoint),
                "inputs": inputs,
                "output_dir": str(output_dir),
                "batch_size": batch,
                "precision": precision,
                "device": config.device,
                "scale": config.scale,
                "workers": config.predict_workers,
            }
            result = call_worker("predict", spec, threads=config.threads, config=config, log_dir=ctx.log_dir)
            ctx.remember_memory(f"predict.py {precision} batch {batch}", result)
            out.append({k: v for k, v in result.items() if k not in ("max_rss_mib", "isolated")})
            ctx.row("predict", f"{precision} batch {batch}", f"{result['images_per_s']:.3g} img/s", "")
    return {"runs": out}


def predict_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """predict.py's images/s: one warm-up call on one batch, then a timed call on every input."""
    import predict

    inputs, batch = spec["inputs"], spec["batch_size"]
    common = ["-m", spec["checkpoint"], "--output-dir", spec["output_dir"], "-b", str(batch)]
    common += ["--precision", spec["precision"], "--device", spec["device"], "--scale", str(spec["scale"])]
    common += ["--workers", str(spec["workers"]), "--no-progress"]
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    status = predict.main([*common, "-i", *inputs[:batch]])
    if status != 0:
        raise MeasurementError(f"predict.py warm-up failed with exit status {status}")
    started = time.perf_counter()
    status = predict.main([*common, "-i", *inputs])
    seconds = time.perf_counter() - started
    if status != 0:
        raise MeasurementError(f"predict.py failed with exit status {status}")
    return {
        "precision": spec["precision"],
        "batch_size": batch,
        "images": len(inputs),
        "seconds": seconds,
        "images_per_s": len(inputs) / seconds,
        "cuda_max_allocated_mib": cuda_max_allocated_mib(device),
    }
