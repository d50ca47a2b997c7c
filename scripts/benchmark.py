"""Measure where a UNet training run's time goes, in one command: a table on stdout and the figures as JSON.

    .venv/bin/python scripts/benchmark.py                                   # 240x160, batch 4, base 64
    .venv/bin/python scripts/benchmark.py --sections compute,e2e --repeat 3 --threads 1 --json bench.json
    .venv/bin/python scripts/benchmark.py --quick --json /tmp/bench.json    # tiny settings (the test's)

Sections (``--sections``, default all):

* ``compute``: images/s of the ``TrainStep`` that ``train.py`` runs (built by its own set-up code from the same flags
  as the e2e run: loss, optimizer, clipping, non-finite guard, scheduler step) on batches held in memory, per
  precision, with FLOPs counted by ``FlopCounterMode`` and the achieved FLOP/s set against this device's measured
  matrix-product peak of the same dtype;
* ``e2e``: the real ``train.py`` on demo data (same model, batch, precision; evaluation never runs because the run
  stops with ``--max-steps`` inside the first epoch); steady-state images/s from ``metrics.jsonl`` timestamps after
  ``--warmup`` steps, and its ratio to ``compute``; each run's log must say it trained in the row's precision (else
  the section fails), and the row shows its threads, loader workers, the spread of its logged intervals and the load
  average around it (a wide spread with a load above the run's threads is other work taking the cores);
* ``epoch``: one whole ``train.py`` epoch of milesial's flags (64 images 480x320, ``-e 1 -b 4 -s 0.5 --amp``, base
  64; quick: 10 images 128x96, base 8) with validation and checkpoints: its wall time split into start-up, steps,
  validation, checkpoint writes, curves and the rest (the trainer's ``phase`` records in ``metrics.jsonl``), and its
  ratio to the compute bound (the epoch's FLOPs at the measured matmul peak of its precision);
* ``compile``: ``train.py`` eager against ``--compile`` in one paired run per precision (two epochs each, the epoch
  ending with a smaller batch, full batches only with ``--quick``, then the compiled run resumed from its run
  folder's compile cache): the compile time
  (the first step, cold and warm cache), the second epoch's steady-state images/s and its time
  (``scripts.bench.compile``);
* ``ddp``: ``torchrun`` with 2 processes of half the threads each against 1 process with all threads, same global
  batch, images/s ratio;
* ``validation``: one validation pass of 64 images (quick: 5) at 2 processes, ``--val-mode rank0`` against
  ``sharded``: rank 0's seconds for each and their ratio (each rank builds train.py's trainer and its loaders);
* ``data``: dataset construction over ``--n-masks`` full-size masks, first (scan) and second (cache) time, each in a
  fresh process; per-item load time; decoders (PIL, torchvision.io); loader items/s per worker (one thread, with
  augmentation) decoding full-size files and reading the pixel cache, against the images/s the model consumes;
  DataLoader throughput alone;
* ``startup``: second dataset construction over ``--startup-pairs`` small pairs (per-file start-up costs);
* ``predict``: ``predict.py`` images/s for each precision at each ``--predict-batch-sizes``;
* ``memory``: peak RSS of every measured process (``wait4``) and CUDA max allocated where on CUDA; the trainer's
  step with and without ``--checkpointing`` (CUDA max allocated, or peak RSS on CPU);
* ``checkpoint``: the checkpoint ``train.py`` writes for a UNet of ``--checkpoint-base-channels`` with AdamW state:
  building the payload, the tensor digests alone, a full atomic save, one more name by byte copy against a second
  save (and their ratio), a ``--resume`` load and its verification alone, the file size; written in a temporary
  folder inside ``--checkpoint-bench-dir`` (default: the runs' ``--checkpoint-dir``), removed afterwards.

``--pixel-cache both`` runs every e2e measurement without and with train.py's ``--pixel-cache`` (filled up front by
``build-cache``), for the cache's effect on end-to-end images/s.

Each measurement runs in its own process with its thread count set before torch starts (``OMP_NUM_THREADS``), so
comparisons are fair and peak memory is per measurement (``--quick`` runs compute, data and predict in this process to
save interpreter start-ups; the checkpoint section always runs in this one). ``--repeat N`` alternates the runs of
each compared pair N times and reports the median ratio, which is what survives a machine shared with other work.
Every section records the load average before and after it; a figure whose repeats spread more than 20 % of their
median, or that is physically impossible (end-to-end above 1.2x compute-only, a matmul peak of 0), is marked
UNRELIABLE in the table and ``"reliable": false`` in the JSON, and is measured once more where the section can.
A failed section is reported and the others still run; the exit status is then 1. Results and their interpretation:
docs/PERFORMANCE.md; the measurements themselves live in ``scripts/bench/`` (one module per section).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Run as a plain script from anywhere: make the repository (and with it ``scripts.bench``) importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from scripts.bench.checkpoint_io import SECTION as CHECKPOINT_SECTION  # noqa: E402
from scripts.bench.checkpoint_io import CheckpointBenchConfig, run_checkpoint  # noqa: E402
from scripts.bench.compile import SECTION as COMPILE_SECTION  # noqa: E402
from scripts.bench.compile import run_compile  # noqa: E402
from scripts.bench.context import CARVANA_SIZE, DDP_PROCESSES, SECTIONS, BenchConfig, Context  # noqa: E402
from scripts.bench.data import run_data, run_startup  # noqa: E402
from scripts.bench.ddp import run_ddp  # noqa: E402
from scripts.bench.epoch import SECTION as EPOCH_SECTION  # noqa: E402
from scripts.bench.epoch import run_epoch  # noqa: E402
from scripts.bench.prediction import run_predict  # noqa: E402
from scripts.bench.processes import MeasurementError, worker_main  # noqa: E402
from scripts.bench.report import new_document, run_memory, update_document  # noqa: E402
from scripts.bench.training import memory_with_checkpointing, run_compute_and_e2e  # noqa: E402
from scripts.bench.validation import SECTION as VALIDATION_SECTION  # noqa: E402
from scripts.bench.validation import run_validation  # noqa: E402
from utils.cli import parse_size, print_error  # noqa: E402
from utils.errors import USER_ERROR_EXIT_CODE, ConfigError  # noqa: E402
from utils.hardware import PRECISIONS, available_cpus, cpu_has_native  # noqa: E402

# ------------------------------------------------------------------------------------------------------ settings


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
    "startup_pairs": "10000,100000",
    "checkpoint_base_channels": 64,
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
    "startup_pairs": "200",
    "checkpoint_base_channels": 8,
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
    add(
        "--pixel-cache",
        choices=("off", "on", "both"),
        default="off",
        help="e2e runs without / with train.py's --pixel-cache, or both (off)",
    )
    add("--startup-pairs", help=f"small pairs of the startup section ({normal['startup_pairs']}; quick 200)")
    add(
        "--checkpoint-base-channels",
        type=int,
        help=f"UNet width of the checkpoint section ({normal['checkpoint_base_channels']}: a 373 MB file; quick "
        f"{quick['checkpoint_base_channels']})",
    )
    add(
        "--checkpoint-bench-dir",
        type=Path,
        help="the checkpoint section writes its files in a temporary folder inside this one, on the filesystem to "
        "measure (default: the folder the measured runs use as --checkpoint-dir, inside --work-dir)",
    )
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
        threads=args.threads or (1 if args.quick else available_cpus()),
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
        pixel_cache=["off", "on"] if args.pixel_cache == "both" else [args.pixel_cache],
        startup_pairs=[int(v) for v in _split(str(pick("startup_pairs")), "--startup-pairs")],
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


def checkpoint_config_from_args(args: argparse.Namespace) -> CheckpointBenchConfig:
    defaults = _QUICK_DEFAULTS if args.quick else _DEFAULTS
    base_channels = args.checkpoint_base_channels
    if base_channels is None:
        base_channels = defaults["checkpoint_base_channels"]
    if base_channels < 1:
        raise ConfigError("--checkpoint-base-channels must be at least 1")
    folder = args.checkpoint_bench_dir
    if folder is not None and folder.exists() and not folder.is_dir():
        raise ConfigError(f"--checkpoint-bench-dir {folder} is a file; give a folder (it is created when missing)")
    return CheckpointBenchConfig(base_channels=base_channels, folder=folder)


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
        (all(n >= 1 for n in config.startup_pairs), "--startup-pairs must be positive"),
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
    return ["fp32", "bf16"] if cpu_has_native("bf16") else ["fp32"]


def _split(text: str, flag: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ConfigError(f"{flag} is empty")
    return items


# ------------------------------------------------------------------------------------------------------- running


def _store(section: str, runner: Callable[[Context], dict[str, Any]]) -> Callable[[Context], None]:
    def run(ctx: Context) -> None:
        ctx.results[section] = runner(ctx)

    return run


def section_runners(checkpoint: CheckpointBenchConfig) -> list[tuple[tuple[str, ...], Callable[[Context], None]]]:
    """The sections in the order they run; compute and e2e run together so that their runs can alternate.

    The checkpoint section runs last: it builds its trainer in this process (see ``scripts.bench.checkpoint_io``).
    """
    return [
        (("compute", "e2e"), run_compute_and_e2e),
        ((EPOCH_SECTION,), _store(EPOCH_SECTION, run_epoch)),
        ((COMPILE_SECTION,), _store(COMPILE_SECTION, run_compile)),
        (("ddp",), _store("ddp", run_ddp)),
        ((VALIDATION_SECTION,), _store(VALIDATION_SECTION, run_validation)),
        (("data",), _store("data", run_data)),
        (("startup",), _store("startup", run_startup)),
        (("predict",), _store("predict", run_predict)),
        (("memory",), _store("memory", lambda ctx: _memory(ctx))),
        ((CHECKPOINT_SECTION,), _store(CHECKPOINT_SECTION, lambda ctx: run_checkpoint(ctx, checkpoint))),
    ]


def _memory(ctx: Context) -> dict[str, Any]:
    """Every measured process's peak, then the step with and without activation checkpointing."""
    checkpointing = memory_with_checkpointing(ctx)
    result = run_memory(ctx)
    measure = "CUDA max allocated" if checkpointing["measure"] == "cuda_max_allocated_mib" else "peak RSS"
    ctx.row(
        "memory",
        f"{measure}, trainer step {ctx.config.size[0]}x{ctx.config.size[1]} batch {ctx.config.batch_size}, "
        "--checkpointing / without",
        f"{checkpointing['with_mib']:.0f} / {checkpointing['without_mib']:.0f} MiB ({checkpointing['ratio']:.2f})",
        f"{checkpointing['images_per_s_with']:.3g} / {checkpointing['images_per_s_without']:.3g} img/s",
    )
    result["checkpointing"] = checkpointing
    return result


def run_benchmark(config: BenchConfig, checkpoint: CheckpointBenchConfig | None = None) -> tuple[dict[str, Any], bool]:
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
    document = new_document(config)
    all_ok = True
    try:
        for sections, runner in section_runners(checkpoint or CheckpointBenchConfig()):
            selected = [section for section in sections if section in config.sections]
            if not selected:
                continue
            section_started, load_before = time.perf_counter(), os.getloadavg()[0]
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
                ctx.results[section]["section_load_average"] = [load_before, os.getloadavg()[0]]
            update_document(document, ctx, started)
        document["complete"] = True
    finally:
        if temporary is not None:
            temporary.cleanup()
    update_document(document, ctx, started)
    return document, all_ok


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.worker:
            return worker_main(args.worker, args.spec)
        config = config_from_args(args)
        checkpoint = checkpoint_config_from_args(args)
    except ConfigError as error:
        print_error(error)
        return USER_ERROR_EXIT_CODE
    # A time limit's SIGTERM ends the run like Ctrl-C: the measured process group is killed on the way out.
    previous_handler = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        document, all_ok = run_benchmark(config, checkpoint)
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
