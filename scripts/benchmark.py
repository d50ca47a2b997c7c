"""Measure where a UNet training run's time goes, in one command: a table on stdout and the figures as JSON.

    .venv/bin/python scripts/benchmark.py                                   # 240x160, batch 4, base 64
    .venv/bin/python scripts/benchmark.py --sections compute,e2e --repeat 3 --threads 1 --json bench.json
    .venv/bin/python scripts/benchmark.py --quick --json /tmp/bench.json    # tiny settings (the test's)

Sections (``--sections``, default all):

* ``compute``: images/s of forward + backward + optimizer step on random tensors (same loss, optimizer and gradient
  clipping as ``train.py``), per precision, with FLOPs counted by ``FlopCounterMode`` and the achieved FLOP/s set
  against this device's measured matrix-product peak of the same dtype;
* ``e2e``: the real ``train.py`` on demo data (same model, batch, precision; evaluation never runs because the run
  stops with ``--max-steps`` inside the first epoch); steady-state images/s from ``metrics.jsonl`` timestamps after
  ``--warmup`` steps, and its ratio to ``compute``;
* ``ddp``: ``torchrun`` with 2 processes of half the threads each against 1 process with all threads, same global
  batch, images/s ratio;
* ``data``: dataset construction over ``--n-masks`` full-size masks, first (scan) and second (cache) time, each in a
  fresh process; per-item load time; decoders (PIL, torchvision.io) and a pre-resized uint8 cache; DataLoader
  throughput alone against the rate the model consumes;
* ``predict``: ``predict.py`` images/s for each precision at each ``--predict-batch-sizes``;
* ``memory``: peak RSS of every measured process (``wait4``) and CUDA max allocated where on CUDA.

Each measurement runs in its own process with its thread count set before torch starts (``OMP_NUM_THREADS``), so
comparisons are fair and peak memory is per measurement (``--quick`` runs compute, data and predict in this process to
save interpreter start-ups). ``--repeat N`` alternates the runs of each compared pair N times and reports the median
ratio, which is what survives a machine shared with other work. A failed section is reported and the others still
run; the exit status is then 1. Results and their interpretation: docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
# Run as a plain script from anywhere: make the repository importable.
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from utils.distributed import LAUNCHER_ENV_VARIABLES  # noqa: E402
from utils.errors import USER_ERROR_EXIT_CODE, ConfigError  # noqa: E402

SECTIONS = ("compute", "e2e", "ddp", "data", "predict", "memory")
PRECISIONS = ("fp32", "bf16", "fp16")
RESULT_PREFIX = "BENCHMARK_RESULT "
SCHEMA_VERSION = 1
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# Carvana's image size: the data section's "full-size" masks.
CARVANA_SIZE = (1918, 1280)
DDP_PROCESSES = 2
# Distinct scenes drawn for generated data; the other files are hard links to them (see write_linked_dataset).
DISTINCT_FULL_SIZE = 4
DISTINCT_DEMO = 32
MIB = 1024 * 1024


# ------------------------------------------------------------------------------------------------------ settings


@dataclass
class BenchConfig:
    """Everything one benchmark run measures; ``--quick`` changes the defaults of the fields the user left unset."""

    sections: list[str]
    device: str
    """``cpu`` or ``cuda`` (``--device auto`` resolved)."""
    size: tuple[int, int]
    """Network input ``(width, height)``."""
    batch_size: int
    """Global batch: one process trains all of it; in the DDP section each of the 2 processes trains half."""
    base_channels: int
    classes: int
    precisions: list[str]
    steps: int
    """Timed optimizer steps per measurement."""
    warmup: int
    """Untimed steps before them (first-step allocations, autotuning, compilation)."""
    repeat: int
    """Alternating (compute, e2e) and (1 process, DDP) pairs per precision; ratios are the pairs' median."""
    threads: int
    """CPU threads of one training process; DDP ranks get ``threads // 2`` each."""
    scale: float
    """``--scale`` of the end-to-end and prediction runs; demo images are drawn at ``size / scale``."""
    data_dir: Path | None
    """Folder with ``imgs/`` and ``masks/`` for end-to-end training; demo data is drawn there when missing."""
    n_masks: int
    full_size: tuple[int, int]
    full_scale: float
    """``--scale`` of the full-size per-item figure (0.5: Carvana's usual 959x640 training input)."""
    items: int
    """Items timed per per-item figure."""
    loader_workers: list[int]
    loader_batches: int
    predict_batch_sizes: list[int]
    predict_images: int
    predict_workers: int
    peak_max_size: int
    """Largest matmul side timed for the peak (0: the device's default)."""
    num_workers: int | None
    """``--num-workers`` of train.py (None: its default)."""
    log_every: int
    channels_last: bool
    compile: bool
    isolate: bool
    timeout: float
    json_path: Path | None
    work_dir: Path | None
    quick: bool


_DEFAULTS: dict[str, Any] = {
    "size": "240x160",
    "batch_size": 4,
    "base_channels": 64,
    "steps": 5,
    "warmup": 2,
    "n_masks": 1000,
    "full_size": f"{CARVANA_SIZE[0]}x{CARVANA_SIZE[1]}",
    "items": 20,
    "loader_workers": "0,1,2",
    "loader_batches": 20,
    "predict_batch_sizes": "1,8",
    "predict_images": 16,
    "predict_workers": 2,
    "peak_max_size": 0,
}
_QUICK_DEFAULTS: dict[str, Any] = {
    "size": "64x48",
    "batch_size": 2,
    "base_channels": 8,
    "steps": 2,
    "warmup": 1,
    "n_masks": 24,
    "full_size": "320x224",
    "items": 3,
    "loader_workers": "0",
    "loader_batches": 3,
    "predict_batch_sizes": "1,2",
    "predict_images": 4,
    "predict_workers": 0,
    "peak_max_size": 512,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scripts/benchmark.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    normal, quick = _DEFAULTS, _QUICK_DEFAULTS
    add("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    add("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when available")
    add("--size", help=f"network input WIDTHxHEIGHT ({normal['size']}; quick {quick['size']})")
    add("--batch-size", "-b", type=int, help=f"global batch ({normal['batch_size']}; quick {quick['batch_size']})")
    add("--base-channels", type=int, help=f"UNet width ({normal['base_channels']}; quick {quick['base_channels']})")
    add("--classes", "-c", type=int, default=2, help="output classes (2)")
    add(
        "--precisions",
        help="comma-separated; default fp32, + bf16 where the hardware has it natively, + fp16 on CUDA; quick fp32",
    )
    add("--steps", type=int, help=f"timed steps ({normal['steps']}; quick {quick['steps']})")
    add("--warmup", type=int, help=f"untimed steps first ({normal['warmup']}; quick {quick['warmup']})")
    add("--repeat", type=int, default=1, help="alternating measurement pairs per ratio, median reported (1)")
    add("--threads", type=int, default=0, help="CPU threads of one process (0: all cores; quick 1)")
    add("--scale", type=float, default=0.5, help="train.py/predict.py --scale; demo data is drawn at size/scale")
    add("--data-dir", type=Path, help="folder with imgs/ and masks/ (demo data is drawn there if missing)")
    add("--n-masks", type=int, help=f"full-size masks for dataset construction ({normal['n_masks']})")
    add("--full-size", help=f"WIDTHxHEIGHT of the full-size data ({normal['full_size']}; quick {quick['full_size']})")
    add("--full-scale", type=float, default=0.5, help="scale of the full-size per-item load figure (0.5)")
    add("--items", type=int, help=f"items timed per per-item figure ({normal['items']})")
    add("--loader-workers", help=f"DataLoader worker counts to time ({normal['loader_workers']})")
    add("--loader-batches", type=int, help=f"batches per loader measurement ({normal['loader_batches']})")
    add("--predict-batch-sizes", help=f"predict.py batch sizes ({normal['predict_batch_sizes']})")
    add("--predict-images", type=int, help=f"images per predict.py measurement ({normal['predict_images']})")
    add("--predict-workers", type=int, help="predict.py --workers (its default, 2; quick 0)")
    add("--peak-max-size", type=int, help="largest matmul side timed for the peak (0: 2048 on CPU, 8192 on CUDA)")
    add("--num-workers", type=int, help="train.py --num-workers (default: train.py's own default)")
    add("--log-every", type=int, default=0, help="train.py --log-every (0: 1 on CPU, steps/4 on CUDA)")
    add("--channels-last", action="store_true", help="channels_last model and inputs (compute, e2e, ddp)")
    add("--compile", action="store_true", help="torch.compile the model (compute, e2e, ddp)")
    add("--isolate", action=argparse.BooleanOptionalAction, default=None, help="one process per measurement")
    add("--timeout", type=float, default=3600.0, help="seconds allowed to each measured process (3600)")
    add("--json", type=Path, help="write the figures here")
    add("--work-dir", type=Path, help="keep run folders and generated data here (default: a temporary folder)")
    add("--quick", action="store_true", help="tiny settings that run in seconds (the test's)")
    # Internal: the orchestrator runs each measurement as `benchmark.py --worker NAME --spec JSON`.
    add("--worker", help=argparse.SUPPRESS)
    add("--spec", help=argparse.SUPPRESS)
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    defaults = _QUICK_DEFAULTS if args.quick else _DEFAULTS

    def pick(name: str) -> Any:
        value = getattr(args, name)
        return defaults[name] if value is None else value

    sections = _split(args.sections, "--sections")
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"--sections: unknown {', '.join(unknown)}; choose from {','.join(SECTIONS)}")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but PyTorch sees no CUDA device; use --device cpu (or auto)")
    if args.precisions is None:
        precisions = ["fp32"] if args.quick else default_precisions(device)
    else:
        precisions = _split(args.precisions, "--precisions")
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad:
        raise ConfigError(f"--precisions: unknown {', '.join(bad)}; choose from {','.join(PRECISIONS)}")
    if "fp16" in precisions and device != "cuda":
        raise ConfigError("--precisions fp16 needs CUDA (train.py refuses fp16 on CPU); use fp32,bf16")
    config = BenchConfig(
        sections=sections,
        device=device,
        size=parse_size(pick("size"), "--size"),
        batch_size=pick("batch_size"),
        base_channels=pick("base_channels"),
        classes=args.classes,
        precisions=precisions,
        steps=pick("steps"),
        warmup=pick("warmup"),
        repeat=args.repeat,
        # Quick runs use one thread: they only check that everything works, and one thread per process is least
        # hurt when other processes load the machine (see docs/PERFORMANCE.md).
        threads=args.threads or (1 if args.quick else _available_cpus()),
        scale=args.scale,
        data_dir=args.data_dir,
        n_masks=pick("n_masks"),
        full_size=parse_size(pick("full_size"), "--full-size"),
        full_scale=args.full_scale,
        items=pick("items"),
        loader_workers=[int(v) for v in _split(str(pick("loader_workers")), "--loader-workers")],
        loader_batches=pick("loader_batches"),
        predict_batch_sizes=[int(v) for v in _split(str(pick("predict_batch_sizes")), "--predict-batch-sizes")],
        predict_images=pick("predict_images"),
        predict_workers=pick("predict_workers"),
        peak_max_size=pick("peak_max_size"),
        num_workers=args.num_workers,
        log_every=args.log_every or (1 if device == "cpu" else max(1, pick("steps") // 4)),
        channels_last=args.channels_last,
        compile=args.compile,
        isolate=(not args.quick) if args.isolate is None else args.isolate,
        timeout=args.timeout,
        json_path=args.json,
        work_dir=args.work_dir,
        quick=args.quick,
    )
    validate(config)
    return config


def validate(config: BenchConfig) -> None:
    checks = [
        (config.batch_size >= 1, "--batch-size must be at least 1"),
        (config.base_channels >= 1, "--base-channels must be at least 1"),
        (config.classes >= 1, "--classes must be at least 1"),
        (config.steps >= 1, "--steps must be at least 1"),
        (config.repeat >= 1, "--repeat must be at least 1"),
        (config.warmup >= 1, "--warmup must be at least 1 (the first step allocates and autotunes)"),
        (config.threads >= 1, "--threads must be positive"),
        (0 < config.scale <= 1, "--scale must be in (0, 1]"),
        (0 < config.full_scale <= 1, "--full-scale must be in (0, 1]"),
        (config.n_masks >= 1, "--n-masks must be at least 1"),
        (config.items >= 1, "--items must be at least 1"),
        (all(w >= 0 for w in config.loader_workers), "--loader-workers must not be negative"),
        (config.loader_batches >= 2, "--loader-batches must be at least 2 (the first batch is not timed)"),
        (all(b >= 1 for b in config.predict_batch_sizes), "--predict-batch-sizes must be positive"),
        (config.predict_images >= 1, "--predict-images must be at least 1"),
        (config.timeout > 0, "--timeout must be positive"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    if "ddp" in config.sections and config.batch_size % DDP_PROCESSES:
        raise ConfigError(
            f"--batch-size {config.batch_size} cannot be split over {DDP_PROCESSES} DDP processes; pass an even "
            "batch size or drop ddp from --sections"
        )


def default_precisions(device: str) -> list[str]:
    """fp32, bf16 where the hardware computes it natively, fp16 on CUDA.

    A CPU without AVX-512 BF16 or AMX only emulates bf16, several times slower than fp32 (docs/PERFORMANCE.md);
    measuring it there would take most of the run's time for a figure nobody should train with. Ask for it
    explicitly with --precisions fp32,bf16.
    """
    if device == "cuda":
        return ["fp32", "bf16", "fp16"] if torch.cuda.is_bf16_supported() else ["fp32", "fp16"]
    return ["fp32", "bf16"] if cpu_has_native_bf16() else ["fp32"]


def cpu_has_native_bf16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def parse_size(text: str, flag: str) -> tuple[int, int]:
    """``"240x160"`` to ``(240, 160)``, width first."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise ConfigError(f"{flag} must look like WIDTHxHEIGHT (e.g. 240x160), got {text!r}")
    return int(parts[0]), int(parts[1])


def _split(text: str, flag: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ConfigError(f"{flag} is empty")
    return items


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ---------------------------------------------------------------------------------------------- pure helpers


@dataclass(frozen=True)
class SteadyState:
    """Images/s between two logged steps of a training run, leaving out the steps before ``from_step``."""

    images_per_s: float
    from_step: int
    to_step: int
    images: int
    seconds: float


def steady_state(events: Sequence[dict[str, Any]], warmup_steps: int) -> SteadyState:
    """Steady-state throughput from ``metrics.jsonl`` train events (global images and wall-clock timestamps).

    The window starts at the first logged step at or after ``warmup_steps`` and ends at the last logged step, so
    start-up, the first allocations and compilation are outside it.
    """
    train = sorted((e for e in events if e.get("event") == "train"), key=lambda e: e["global_step"])
    starts = [e for e in train if e["global_step"] >= warmup_steps]
    if len(starts) < 2:
        raise ValueError(
            f"need two logged steps at or after step {warmup_steps}, got steps {[e['global_step'] for e in train]}"
        )
    first, last = starts[0], starts[-1]
    images = int(last["images_seen"] - first["images_seen"])
    seconds = float(last["time"] - first["time"])
    if seconds <= 0 or images <= 0:
        raise ValueError(f"no progress between steps {first['global_step']} and {last['global_step']}")
    return SteadyState(images / seconds, int(first["global_step"]), int(last["global_step"]), images, seconds)


def demo_image_count(total_steps: int, batch_size: int, validation_percent: float = 10.0) -> int:
    """Images to draw so that ``total_steps`` batches fit in the first epoch with a batch to spare.

    Staying inside the first epoch keeps validation (run at epoch ends) out of the end-to-end measurement.
    """
    needed_train = (total_steps + 1) * batch_size
    count = math.ceil(needed_train / (1 - validation_percent / 100)) + 1
    return max(16, count)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


# ------------------------------------------------------------------------------------------- child processes


class MeasurementError(RuntimeError):
    """A measured process failed; the message carries the end of its output."""


@dataclass
class ChildRun:
    returncode: int
    wall_s: float
    max_rss_mib: float
    """Peak RSS of the largest process of the tree (the child or any of its descendants it waited for)."""
    output: str


def child_env(threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV_VARIABLES}
    for name in THREAD_VARIABLES:
        env[name] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_child(command: Sequence[str], *, threads: int, timeout: float, log_path: Path) -> ChildRun:
    """Run ``command`` in its own process group; its output goes to ``log_path``; peak RSS comes from ``wait4``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            list(command),
            cwd=REPO_ROOT,
            env=child_env(threads),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        timed_out = threading.Event()

        def kill_group() -> None:
            timed_out.set()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)

        timer = threading.Timer(timeout, kill_group)
        timer.start()
        try:
            _, status, usage = os.wait4(process.pid, 0)
        except BaseException:
            # Interrupted (Ctrl-C, SIGTERM): the child runs in a session of its own, so take it down explicitly.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(process.pid, 0)
            raise
        finally:
            timer.cancel()
        process.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    output = log_path.read_text(errors="replace")
    if timed_out.is_set():
        raise MeasurementError(f"{_shown(command)} ran past --timeout {timeout:g} s; see {log_path}")
    return ChildRun(process.returncode, wall, usage.ru_maxrss / 1024, output)


def _shown(command: Sequence[str]) -> str:
    return " ".join(str(part) for part in command[:6]) + (" ..." if len(command) > 6 else "")


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def call_worker(name: str, spec: dict[str, Any], *, threads: int, config: BenchConfig, log_dir: Path) -> dict[str, Any]:
    """Run worker ``name`` in a fresh process (``config.isolate``) or in this one; its result dict plus memory."""
    spec = {**spec, "threads": threads}
    if not config.isolate:
        torch.set_num_threads(threads)
        with contextlib.redirect_stdout(io.StringIO()):
            result = WORKERS[name](spec)
        result["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        result["isolated"] = False
        return result
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--spec", json.dumps(spec)]
    log_path = log_dir / f"{name}-{int(time.time() * 1000)}.log"
    run = run_child(command, threads=threads, timeout=config.timeout, log_path=log_path)
    lines = [line for line in run.output.splitlines() if line.startswith(RESULT_PREFIX)]
    if run.returncode != 0 or not lines:
        raise MeasurementError(f"worker {name} failed (exit {run.returncode}):\n{_tail(run.output)}")
    result = json.loads(lines[-1][len(RESULT_PREFIX) :])
    result["max_rss_mib"] = run.max_rss_mib
    result["isolated"] = True
    return result


# ------------------------------------------------------------------------------------------------- workers
# Each worker takes a JSON-able spec and returns a JSON-able dict; heavy imports stay inside so that the
# orchestrator starts quickly and a worker's thread count is set before its first parallel region.


def compute_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Bare training steps on random tensors: forward, loss, backward, clipping, optimizer step."""
    from unet import UNet
    from utils.config import TrainConfig
    from utils.flops import measure_matmul_peak, training_flops_per_image
    from utils.losses import segmentation_loss
    from utils.optim import build_optimizer

    device = torch.device(spec["device"])
    precision, classes, batch = spec["precision"], spec["classes"], spec["batch_size"]
    width, height = spec["size"]
    torch.backends.cudnn.benchmark = True  # train.py's choice when not --deterministic
    model_args = {"n_channels": 3, "n_classes": classes, "bilinear": False, "base_channels": spec["base_channels"]}

    def loss_fn(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        return segmentation_loss(logits, masks, classes)

    flops = training_flops_per_image(lambda: UNet(**model_args), loss_fn, channels=3, height=height, width=width)
    peaks = [measure_matmul_peak(precision, device, max_size=spec["peak_max_size"] or None)]

    torch.manual_seed(0)
    memory_format = torch.channels_last if spec["channels_last"] else torch.contiguous_format
    model = UNet(**model_args).to(device=device, memory_format=memory_format)
    model.train()
    step_model = torch.compile(model) if spec["compile"] else model
    defaults = TrainConfig()  # the optimizer and clipping train.py uses by default
    optimizer = build_optimizer(defaults, model.parameters())
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    images = torch.rand(batch, 3, height, width, device=device).contiguous(memory_format=memory_format)
    masks = torch.randint(0, max(classes, 2), (batch, height, width), device=device)

    def step() -> None:
        with torch.autocast(device.type, autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            loss = loss_fn(step_model(images), masks)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        else:
            loss.backward()
        if defaults.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), defaults.grad_clip)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    warmup_times = [_timed(step, device) for _ in range(spec["warmup"])]
    # No synchronisation between timed steps (train.py has none either): on a GPU the per-step figures are then
    # launch times, and only the total, synchronised at both ends, counts.
    step_times = []
    _sync(device)
    started = time.perf_counter()
    for _ in range(spec["steps"]):
        step_started = time.perf_counter()
        step()
        step_times.append(time.perf_counter() - step_started)
    _sync(device)
    total = time.perf_counter() - started
    images_per_s = batch * spec["steps"] / total
    # Measured again after the steps, the best of the two kept: a peak taken while other work briefly held the
    # device would make the steps look faster than the peak.
    peaks.append(measure_matmul_peak(precision, device, max_size=spec["peak_max_size"] or None))
    peak = max(peaks, key=lambda p: p.flops_per_s)
    return {
        "precision": precision,
        "images_per_s": images_per_s,
        "step_s_median": statistics.median(step_times),
        "first_step_s": warmup_times[0],
        "flops_per_image": flops,
        "achieved_flops_per_s": flops * images_per_s,
        "matmul_peak_flops_per_s": peak.flops_per_s,
        "matmul_peak_size": peak.size,
        "fraction_of_peak": flops * images_per_s / peak.flops_per_s,
        "cuda_max_allocated_mib": _cuda_max_allocated(device),
    }


def data_build_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Construct a CarvanaDataset once (mask scan, or its cache when one matches)."""
    from utils.data_loading import CarvanaDataset

    started = time.perf_counter()
    dataset = CarvanaDataset(spec["imgs"], spec["masks"], 1.0, cache_dir=spec["cache_dir"])
    return {"seconds": time.perf_counter() - started, "n_items": len(dataset)}


def data_load_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Per-item load times, decoder comparisons, a pre-resized uint8 cache, and DataLoader throughput."""
    from torch.utils.data import DataLoader

    from utils.data_loading import BasicDataset, CarvanaDataset, detect_mask_suffix

    result: dict[str, Any] = {}
    # Loader worker processes run one thread each (PyTorch sets that); the per-item figures do the same.
    torch.set_num_threads(1)
    demo = BasicDataset(
        spec["demo_imgs"], spec["demo_masks"], spec["scale"], detect_mask_suffix(spec["demo_imgs"], spec["demo_masks"])
    )
    full = CarvanaDataset(spec["full_imgs"], spec["full_masks"], spec["full_scale"], cache_dir=spec["cache_dir"])
    result["item_ms_demo"] = 1000 * _per_item_seconds(demo, spec["items"])
    result["item_ms_full"] = 1000 * _per_item_seconds(full, spec["items"])
    result["item_shape_demo"] = list(demo[0]["image"].shape)
    result["item_shape_full"] = list(full[0]["image"].shape)
    result["decode"] = _decoder_times(Path(spec["full_imgs"]), Path(spec["full_masks"]), spec["items"])
    with tempfile.TemporaryDirectory(prefix="unet-bench-cache-") as cache:
        result["cached_uint8_item_ms_demo"] = 1000 * _cached_item_seconds(demo, Path(cache), spec["items"])
        result["cached_uint8_item_ms_full"] = 1000 * _cached_item_seconds(full, Path(cache), spec["items"])

    torch.set_num_threads(spec["threads"])  # a loader without workers decodes in the training process
    loaders = []
    for workers in spec["loader_workers"]:
        loader = DataLoader(demo, batch_size=spec["batch_size"], shuffle=True, num_workers=workers, drop_last=True)
        loaders.append({"num_workers": workers, **_loader_rate(loader, spec["loader_batches"])})
    result["loader"] = loaders
    return result


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
        "cuda_max_allocated_mib": _cuda_max_allocated(device),
    }


WORKERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "compute": compute_worker,
    "data-build": data_build_worker,
    "data-load": data_load_worker,
    "predict": predict_worker,
}


def _timed(step: Callable[[], None], device: torch.device) -> float:
    _sync(device)
    started = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - started


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cuda_max_allocated(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / MIB if device.type == "cuda" else None


def _per_item_seconds(dataset: Any, count: int) -> float:
    dataset[0]  # first-use costs (imports, codec set-up) are not per-item costs
    started = time.perf_counter()
    for index in range(count):
        dataset[index % len(dataset)]
    return (time.perf_counter() - started) / count


def _decoder_times(images_dir: Path, masks_dir: Path, count: int) -> dict[str, float]:
    """Milliseconds to decode one full-size JPEG image and one GIF mask, with PIL and with torchvision.io."""
    import numpy as np
    import torchvision.io as tvio
    from PIL import Image

    image_path = str(sorted(images_dir.glob("*.jpg"))[0])
    mask_path = str(sorted(masks_dir.glob("*.gif"))[0])

    def pil(path: str) -> object:
        with Image.open(path) as img:
            return np.asarray(img)

    decoders: dict[str, Callable[[], object]] = {
        "jpeg_pil_ms": lambda: pil(image_path),
        "jpeg_torchvision_ms": lambda: tvio.decode_jpeg(tvio.read_file(image_path)),
        "gif_pil_ms": lambda: pil(mask_path),
        "gif_torchvision_ms": lambda: tvio.decode_gif(tvio.read_file(mask_path)),
    }
    timings = {}
    with warnings.catch_warnings():
        # torchvision 0.29 deprecates its codecs for TorchCodec and warns at every call; timing them is the point.
        warnings.simplefilter("ignore", DeprecationWarning)
        for name, decode in decoders.items():
            decode()
            started = time.perf_counter()
            for _ in range(count):
                decode()
            timings[name] = 1000 * (time.perf_counter() - started) / count
    return timings


def _cached_item_seconds(dataset: Any, folder: Path, count: int) -> float:
    """Per-item cost of reading a pre-resized uint8 image and mask (.npy) and making the training tensors."""
    import numpy as np

    item = dataset[0]
    image_file, mask_file = folder / "image.npy", folder / "mask.npy"
    np.save(image_file, (item["image"] * 255).round().to(torch.uint8).numpy())
    np.save(mask_file, item["mask"].to(torch.uint8).numpy())
    started = time.perf_counter()
    for _ in range(count):
        image = torch.from_numpy(np.load(image_file)).to(torch.float32).div_(255)
        mask = torch.from_numpy(np.load(mask_file)).to(torch.long)
    assert image.shape == item["image"].shape and mask.shape == item["mask"].shape
    return (time.perf_counter() - started) / count


def _loader_rate(loader: Any, batches: int) -> dict[str, float]:
    """Images/s of iterating ``loader`` alone, from the first batch to the last (worker start-up left out)."""
    delivered, timer_start, images, first_batch_s = 0, 0.0, 0, 0.0
    started = time.perf_counter()
    while delivered < batches:
        for batch in loader:
            delivered += 1
            if delivered == 1:
                timer_start = time.perf_counter()
                first_batch_s = timer_start - started
            else:
                images += batch["image"].shape[0]
            if delivered >= batches:
                break
    seconds = time.perf_counter() - timer_start
    return {"images_per_s": images / seconds, "first_batch_s": first_batch_s, "batches": delivered}


def worker_main(name: str, spec_json: str) -> int:
    spec = json.loads(spec_json)
    if "threads" in spec:
        torch.set_num_threads(spec["threads"])
    result = WORKERS[name](spec)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


# ------------------------------------------------------------------------------------------------ sections


@dataclass
class Context:
    """What the sections share: settings, folders, the results so far and the table rows."""

    config: BenchConfig
    work_dir: Path
    results: dict[str, Any] = field(default_factory=dict)
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)

    @property
    def log_dir(self) -> Path:
        return self.work_dir / "logs"

    def row(self, section: str, measurement: str, value: str, note: str = "") -> None:
        self.rows.append((section, measurement, value, note))

    def remember_memory(self, process: str, result: dict[str, Any]) -> None:
        self.memory.append(
            {
                "process": process,
                "max_rss_mib": result.get("max_rss_mib"),
                "cuda_max_allocated_mib": result.get("cuda_max_allocated_mib"),
                "isolated": result.get("isolated", True),
            }
        )


def run_compute_and_e2e(ctx: Context) -> None:
    """The compute and e2e sections, alternating per precision: compute, train.py, compute, train.py, ...

    Each end-to-end figure is paired with the compute figure taken just before it, and the reported ratio is the
    median of the pairs' ratios: on a machine shared with other work the load drifts over minutes, and a compute run
    taken long before its end-to-end run would make the ratio measure the drift (see docs/PERFORMANCE.md).
    """
    config = ctx.config
    want_compute, want_e2e = "compute" in config.sections, "e2e" in config.sections
    data = ensure_demo_data(ctx) if want_e2e else None
    compute_out: dict[str, Any] = {}
    e2e_out: dict[str, Any] = {}
    for precision in config.precisions:
        computes: list[dict[str, Any]] = []
        trains: list[dict[str, Any]] = []
        for repeat in range(config.repeat):
            if want_compute:
                computes.append(compute_run(ctx, precision))
            if want_e2e:
                assert data is not None
                name = f"e2e-{precision}" + (f"-{repeat + 1}" if config.repeat > 1 else "")
                trains.append(train_run(ctx, data, precision, processes=1, name=name))
        if computes:
            compute_out[precision] = _median_run(computes)
            ctx.remember_memory(f"compute {precision}", compute_out[precision])
            _compute_row(ctx, precision, compute_out[precision])
        if trains:
            e2e_out[precision] = result = _median_run(trains)
            ratios = [t["images_per_s"] / c["images_per_s"] for c, t in zip(computes, trains, strict=False)]
            result["ratios_to_compute"] = ratios
            result["ratio_to_compute"] = statistics.median(ratios) if ratios else None
            _e2e_row(ctx, precision, result)
    if want_compute:
        ctx.results["compute"] = compute_out
    if want_e2e:
        ctx.results["e2e"] = e2e_out


def compute_run(ctx: Context, precision: str) -> dict[str, Any]:
    config = ctx.config
    spec = {
        "device": config.device,
        "precision": precision,
        "size": list(config.size),
        "batch_size": config.batch_size,
        "base_channels": config.base_channels,
        "classes": config.classes,
        "steps": config.steps,
        "warmup": config.warmup,
        "channels_last": config.channels_last,
        "compile": config.compile,
        "peak_max_size": config.peak_max_size,
    }
    return call_worker("compute", spec, threads=config.threads, config=config, log_dir=ctx.log_dir)


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median images/s (the lower middle one of an even count), plus every run's figure."""
    rates = [run["images_per_s"] for run in runs]
    chosen = dict(runs[rates.index(statistics.median_low(rates))])
    chosen["images_per_s_runs"] = rates
    return chosen


def _spread(result: dict[str, Any]) -> str:
    rates = result["images_per_s_runs"]
    return f" ({min(rates):.3g}-{max(rates):.3g}, {len(rates)} runs)" if len(rates) > 1 else ""


def _compute_row(ctx: Context, precision: str, result: dict[str, Any]) -> None:
    ctx.row(
        "compute",
        f"{precision} forward+backward+step",
        f"{result['images_per_s']:.3g} img/s{_spread(result)}",
        f"{result['flops_per_image'] / 1e9:.1f} GFLOP/img; {result['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s = "
        f"{100 * result['fraction_of_peak']:.0f}% of {precision} matmul peak "
        f"{result['matmul_peak_flops_per_s'] / 1e9:.1f} GFLOP/s",
    )


def _e2e_row(ctx: Context, precision: str, result: dict[str, Any]) -> None:
    ratios = result["ratios_to_compute"]
    if not ratios:
        note = "(run the compute section too for the ratio)"
    elif len(ratios) == 1:
        note = f"{ratios[0]:.2f} of compute-only"
    else:
        note = f"{result['ratio_to_compute']:.2f} of compute-only (median of {len(ratios)} paired runs: "
        note += ", ".join(f"{r:.2f}" for r in ratios) + ")"
    if result["validation_ran"]:
        note += "; validation ran inside the window (too few images in --data-dir)"
    ctx.row("e2e", f"{precision} train.py steady state", f"{result['images_per_s']:.3g} img/s{_spread(result)}", note)


def run_ddp(ctx: Context) -> dict[str, Any]:
    """2 processes with half the threads each against 1 process with all of them, same global batch, alternating."""
    config = ctx.config
    precision = config.precisions[0]
    if config.device == "cuda" and torch.cuda.device_count() < DDP_PROCESSES:
        ctx.row("ddp", "skipped", "-", f"needs {DDP_PROCESSES} GPUs, {torch.cuda.device_count()} visible")
        return {"skipped": f"needs {DDP_PROCESSES} GPUs"}
    data = ensure_demo_data(ctx)
    singles, multis = [], []
    for repeat in range(config.repeat):
        suffix = f"{precision}" + (f"-{repeat + 1}" if config.repeat > 1 else "")
        single = ctx.results.get("e2e", {}).get(precision)
        # The e2e run just before this section is a single-process run of the same settings: reuse it when it is
        # the most recent run (one precision, one repeat) instead of paying for another one.
        reusable = single is not None and config.repeat == 1 and config.precisions == [precision]
        if not reusable:
            single = train_run(ctx, data, precision, processes=1, name=f"ddp-single-{suffix}")
        singles.append(single)
        multis.append(train_run(ctx, data, precision, processes=DDP_PROCESSES, name=f"ddp-{DDP_PROCESSES}-{suffix}"))
    single, multi = _median_run(singles), _median_run(multis)
    ratios = [m["images_per_s"] / s["images_per_s"] for s, m in zip(singles, multis, strict=True)]
    threads_each = max(1, config.threads // DDP_PROCESSES)
    result = {
        "precision": precision,
        "global_batch": config.batch_size,
        "single": {"processes": 1, "threads": config.threads, **_pick(single)},
        "multi": {"processes": DDP_PROCESSES, "threads_per_process": threads_each, **_pick(multi)},
        "ratios": ratios,
        "ratio": statistics.median(ratios),
    }
    spread = f" (median of {len(ratios)}: {', '.join(f'{r:.2f}' for r in ratios)})" if len(ratios) > 1 else ""
    ctx.row(
        "ddp",
        f"{precision} {DDP_PROCESSES} proc x {threads_each} thr vs 1 proc x {config.threads} thr",
        f"{multi['images_per_s']:.3g} vs {single['images_per_s']:.3g} img/s",
        f"ratio {result['ratio']:.2f}{spread} (global batch {config.batch_size})",
    )
    return result


def _pick(run: dict[str, Any]) -> dict[str, Any]:
    keys = ("images_per_s", "images_per_s_runs", "steps_timed", "seconds_timed", "max_rss_mib", "wall_s")
    return {key: run.get(key) for key in keys}


def train_run(ctx: Context, data: Path, precision: str, *, processes: int, name: str) -> dict[str, Any]:
    """Run train.py (under torchrun when ``processes > 1``) and return its steady-state throughput."""
    config = ctx.config
    total_steps = _logged_total_steps(config)
    threads = max(1, config.threads // processes)
    run_root = ctx.work_dir / "runs"
    args = [
        "--imgs", str(data / "imgs"), "--masks", str(data / "masks"), "--scale", str(config.scale),
        "--batch-size", str(config.batch_size // processes), "--base-channels", str(config.base_channels),
        "--classes", str(config.classes), "--precision", precision, "--epochs", "1",
        "--max-steps", str(total_steps), "--log-every", str(config.log_every), "--checkpoint-dir", str(run_root),
        "--exp_name", name, "--seed", "0", "--threads", str(threads), "--device", config.device,
        "--wandb", "disabled", "--validation", "10",
    ]  # fmt: skip
    if config.num_workers is not None:
        args += ["--num-workers", str(config.num_workers)]
    if config.channels_last:
        args.append("--channels-last")
    if config.compile:
        args.append("--compile")
    train_py = str(REPO_ROOT / "train.py")
    if processes > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
        command = [*launcher, train_py, "--ddp_mode", *args]
    else:
        command = [sys.executable, train_py, *args]
    shutil.rmtree(run_root / name, ignore_errors=True)
    run = run_child(command, threads=threads, timeout=config.timeout, log_path=ctx.log_dir / f"{name}.log")
    if run.returncode != 0:
        raise MeasurementError(f"{name}: train.py exited with {run.returncode}:\n{_tail(run.output)}")
    metrics = run_root / name / "metrics.jsonl"
    events = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rate = steady_state(events, config.warmup)
    validated = any(e.get("event") == "val" for e in events)
    result = {
        "precision": precision,
        "processes": processes,
        "threads_per_process": threads,
        "images_per_s": rate.images_per_s,
        "steps_timed": rate.to_step - rate.from_step,
        "seconds_timed": rate.seconds,
        "validation_ran": validated,
        "wall_s": run.wall_s,
        "max_rss_mib": run.max_rss_mib,
    }
    ctx.remember_memory(f"train.py {name}" + (f" (largest of {processes} ranks)" if processes > 1 else ""), result)
    return result


def _logged_total_steps(config: BenchConfig) -> int:
    """Warm-up plus timed steps, rounded up to a logged step so the last step is in metrics.jsonl."""
    wanted = config.warmup + config.steps
    return math.ceil(wanted / config.log_every) * config.log_every


def run_data(ctx: Context) -> dict[str, Any]:
    config = ctx.config
    demo = ensure_demo_data(ctx)
    full = write_linked_dataset(
        ctx.work_dir / "full-size", config.n_masks, config.full_size, distinct=DISTINCT_FULL_SIZE
    )
    cache_dir = ctx.work_dir / "mask-value-cache"
    shutil.rmtree(cache_dir, ignore_errors=True)
    build_spec = {"imgs": str(full / "imgs"), "masks": str(full / "masks"), "cache_dir": str(cache_dir)}
    builds = []
    for attempt in ("first", "second"):
        result = call_worker("data-build", build_spec, threads=config.threads, config=config, log_dir=ctx.log_dir)
        builds.append(result)
        ctx.remember_memory(f"dataset construction ({attempt})", result)
    first, second = builds
    ctx.row(
        "data",
        f"dataset construction, {config.n_masks} masks {config.full_size[0]}x{config.full_size[1]}",
        f"{first['seconds']:.3g} s / {second['seconds']:.3g} s",
        f"first (scan) / second (cache): {first['seconds'] / second['seconds']:.0f}x faster",
    )
    load_spec = {
        "demo_imgs": str(demo / "imgs"),
        "demo_masks": str(demo / "masks"),
        "scale": config.scale,
        "full_imgs": str(full / "imgs"),
        "full_masks": str(full / "masks"),
        "full_scale": config.full_scale,
        "cache_dir": str(cache_dir),
        "items": config.items,
        "batch_size": config.batch_size,
        "loader_workers": config.loader_workers,
        "loader_batches": config.loader_batches,
    }
    load = call_worker("data-load", load_spec, threads=config.threads, config=config, log_dir=ctx.log_dir)
    ctx.remember_memory("data loading", load)
    compute = ctx.results.get("compute", {})
    consumption = compute.get(config.precisions[0], {}).get("images_per_s")
    for entry in load["loader"]:
        entry["ratio_to_model"] = ratio(entry["images_per_s"], consumption)
    _data_rows(ctx, load, consumption)
    return {
        "n_masks": config.n_masks,
        "full_size": list(config.full_size),
        "build_first_s": first["seconds"],
        "build_second_s": second["seconds"],
        "model_images_per_s": consumption,
        **{key: value for key, value in load.items() if key not in ("max_rss_mib", "isolated")},
    }


def _data_rows(ctx: Context, load: dict[str, Any], consumption: float | None) -> None:
    config = ctx.config
    demo_shape, full_shape = load["item_shape_demo"], load["item_shape_full"]
    ctx.row(
        "data",
        f"item load, demo -> {demo_shape[2]}x{demo_shape[1]} (1 thread)",
        f"{load['item_ms_demo']:.3g} ms",
        f"pre-resized uint8 cache: {load['cached_uint8_item_ms_demo']:.3g} ms",
    )
    ctx.row(
        "data",
        f"item load, {config.full_size[0]}x{config.full_size[1]} -> {full_shape[2]}x{full_shape[1]} (1 thread)",
        f"{load['item_ms_full']:.3g} ms",
        f"pre-resized uint8 cache: {load['cached_uint8_item_ms_full']:.3g} ms",
    )
    decode = load["decode"]
    ctx.row(
        "data",
        f"decode {config.full_size[0]}x{config.full_size[1]} JPEG / GIF mask, PIL",
        f"{decode['jpeg_pil_ms']:.3g} / {decode['gif_pil_ms']:.3g} ms",
        f"torchvision.io: {decode['jpeg_torchvision_ms']:.3g} / {decode['gif_torchvision_ms']:.3g} ms",
    )
    for entry in load["loader"]:
        note = (
            f"{entry['ratio_to_model']:.3g}x what the {config.precisions[0]} model consumes ({consumption:.3g} img/s)"
            if entry["ratio_to_model"] is not None
            else "(run compute to compare with the model's rate)"
        )
        ctx.row("data", f"DataLoader alone, {entry['num_workers']} workers", f"{entry['images_per_s']:.3g} img/s", note)


def run_predict(ctx: Context) -> dict[str, Any]:
    from unet import UNet
    from utils.checkpoint import (
        FORMAT_VERSION,
        KEY_FORMAT_VERSION,
        KEY_MASK_VALUES,
        KEY_MODEL,
        KEY_MODEL_ARGS,
        save_checkpoint_atomic,
    )

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


def run_memory(ctx: Context) -> list[dict[str, Any]]:
    for entry in ctx.memory:
        cuda = entry["cuda_max_allocated_mib"]
        note = f"CUDA max allocated {cuda:.0f} MiB" if cuda is not None else ""
        if not entry["isolated"]:
            note = (note + "; " if note else "") + "in the benchmark's process: peak so far, not per measurement"
        ctx.row("memory", f"peak RSS, {entry['process']}", f"{entry['max_rss_mib']:.0f} MiB", note)
    return ctx.memory


def ensure_demo_data(ctx: Context) -> Path:
    """The end-to-end data folder: ``--data-dir`` when it holds images, else demo data drawn there (or in work)."""
    config = ctx.config
    folder = config.data_dir or ctx.work_dir / "demo-data"
    generated_here = any(folder.glob(".complete-*"))
    if not generated_here and (folder / "imgs").is_dir() and any((folder / "imgs").iterdir()):
        return folder  # the user's own data, used as it is
    width, height = config.size
    size = (round(width / config.scale), round(height / config.scale))
    needed = max(
        demo_image_count(_logged_total_steps(config), config.batch_size),
        config.predict_images,
        max(config.predict_batch_sizes),
    )
    return write_linked_dataset(folder, needed, size, distinct=DISTINCT_DEMO)


def write_linked_dataset(folder: Path, count: int, size: tuple[int, int], *, distinct: int) -> Path:
    """``count`` Carvana-style image/mask pairs in ``folder``: ``distinct`` drawn scenes, the rest hard links to them.

    Decoding cost does not depend on the content, and drawing hundreds of full-size scenes would take longer than
    the measurement. Every link is a file name of its own, which the mask scan opens and decodes, and which the
    value cache's key lists (a link shares its target's size and mtime, as a copy made by ``cp -p`` would).
    """
    from utils.synthetic import generate_carvana_like

    for existing in folder.glob(f".complete-*-{size[0]}x{size[1]}"):
        if int(existing.name.split("-")[1]) >= count:
            return folder  # an earlier, larger set of the same size serves as well
    marker = folder / f".complete-{count}-{size[0]}x{size[1]}"
    # Only folders this function wrote (or empty ones) get here: replace an earlier set of another count or size.
    for old in (*folder.glob(".complete-*"), folder / ".source", folder / "imgs", folder / "masks"):
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink(missing_ok=True)
    source = folder / ".source"
    names = generate_carvana_like(source, min(distinct, count), size=size, seed=0)
    for sub in ("imgs", "masks"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    for index in range(count):
        name = names[index % len(names)]
        # Carvana-style ids (12 hex digits, view number), distinct from the drawn scenes' names.
        new_name = f"{index:012x}_{index % 16 + 1:02d}"
        _link_or_copy(source / "imgs" / f"{name}.jpg", folder / "imgs" / f"{new_name}.jpg")
        _link_or_copy(source / "masks" / f"{name}_mask.gif", folder / "masks" / f"{new_name}_mask.gif")
    marker.touch()
    return folder


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


# ---------------------------------------------------------------------------------------------------- report


def machine_info(config: BenchConfig) -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cpus_available": _available_cpus(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_native_bf16": cpu_has_native_bf16(),
        "device": config.device,
        "load_average_start": os.getloadavg()[0],
    }
    if config.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    return info


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def format_table(rows: Sequence[tuple[str, str, str, str]]) -> str:
    header = ("section", "measurement", "value", "note")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(3)]
    lines = []
    for row in [header, *rows]:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)) + "  " + row[3])
        if row is header:
            lines.append("  ".join("-" * width for width in widths) + "  " + "-" * 4)
    return "\n".join(line.rstrip() for line in lines)


def _store(section: str, runner: Callable[[Context], dict[str, Any]]) -> Callable[[Context], None]:
    def run(ctx: Context) -> None:
        ctx.results[section] = runner(ctx)

    return run


# In this order; compute and e2e run together so that their runs can alternate.
SECTION_RUNNERS: list[tuple[tuple[str, ...], Callable[[Context], None]]] = [
    (("compute", "e2e"), run_compute_and_e2e),
    (("ddp",), _store("ddp", run_ddp)),
    (("data",), _store("data", run_data)),
    (("predict",), _store("predict", run_predict)),
    (("memory",), _store("memory", lambda ctx: {"processes": run_memory(ctx)})),
]


def run_benchmark(config: BenchConfig) -> tuple[dict[str, Any], bool]:
    """Run the selected sections in order; return the JSON document and whether every section succeeded.

    With ``--json`` the document is rewritten after every section (``"complete": false`` until the end), so a run
    stopped by a time limit still leaves the figures it had.
    """
    started = time.perf_counter()
    temporary = None
    if config.work_dir is None:
        temporary = tempfile.TemporaryDirectory(prefix="unet-benchmark-")
        work_dir = Path(temporary.name)
    else:
        work_dir = config.work_dir
        work_dir.mkdir(parents=True, exist_ok=True)
    ctx = Context(config, work_dir)
    document: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "complete": False,
        "machine": machine_info(config),
        "settings": _settings(config),
    }
    all_ok = True
    try:
        for sections, runner in SECTION_RUNNERS:
            selected = [section for section in sections if section in config.sections]
            if not selected:
                continue
            section_started = time.perf_counter()
            print(f"[benchmark] {' + '.join(selected)} ...", file=sys.stderr, flush=True)
            try:
                runner(ctx)
            except (MeasurementError, ValueError, OSError, RuntimeError) as error:
                all_ok = False
                for section in selected:
                    ctx.results[section] = {"error": str(error)}
                    ctx.row(section, "FAILED", "-", str(error).splitlines()[0])
                print(f"[benchmark] {' + '.join(selected)} failed: {error}", file=sys.stderr, flush=True)
            for section in selected:
                ctx.results[section]["section_wall_s"] = time.perf_counter() - section_started
            _update(document, ctx, started)
        document["complete"] = True
    finally:
        if temporary is not None:
            temporary.cleanup()
    _update(document, ctx, started)
    return document, all_ok


def _update(document: dict[str, Any], ctx: Context, started: float) -> None:
    document.update(ctx.results)
    document["machine"]["load_average_end"] = os.getloadavg()[0]
    document["wall_s"] = time.perf_counter() - started
    document["table"] = format_table(ctx.rows)
    path = ctx.config.json_path
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.tmp")
        partial.write_text(json.dumps(document, indent=2) + "\n")
        os.replace(partial, path)


def _settings(config: BenchConfig) -> dict[str, Any]:
    settings = asdict(config)
    for key in ("data_dir", "json_path", "work_dir"):
        settings[key] = None if settings[key] is None else str(settings[key])
    settings["size"] = f"{config.size[0]}x{config.size[1]}"
    settings["full_size"] = f"{config.full_size[0]}x{config.full_size[1]}"
    return settings


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.worker:
            return worker_main(args.worker, args.spec)
        config = config_from_args(args)
    except ConfigError as error:
        print(f"Error: {error}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    # A time limit's SIGTERM ends the run like Ctrl-C: the measured process group is killed on the way out.
    previous_handler = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        document, all_ok = run_benchmark(config)
    except KeyboardInterrupt:
        done = config.json_path is not None and config.json_path.exists()
        saved = f"; the sections finished before it are in {config.json_path}" if done else ""
        print(f"Interrupted{saved}", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
    width, height = config.size
    print(
        f"UNet base {config.base_channels}, {width}x{height}, batch {config.batch_size}, {config.device} "
        f"({config.threads} threads), {document['machine']['cpu']}; load average "
        f"{document['machine']['load_average_start']:.1f} at start, {document['machine']['load_average_end']:.1f} "
        f"at end; {document['wall_s']:.0f} s"
    )
    print(document["table"])
    return 0 if all_ok else 1


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
