"""Bounds from the machine (utils/hardware.py): one Error: line before anything is created or built."""

from __future__ import annotations

import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, SyntheticData, TrainRunner, child_env
from tests.helpers import one_error_line, save_checkpoint, tiny_unet
from unet import UNetArgs
from utils import hardware
from utils.errors import ConfigError
from utils.hardware import MIN_WORKERS_BOUND, WORKERS_PER_CPU, available_cpus


@pytest.mark.slow
def test_train_refuses_more_threads_than_the_machine_has_before_creating_the_run_folder(runner: TrainRunner) -> None:
    # A real process: on the code before these bounds --threads 100000 crashed the interpreter (SIGSEGV). The
    # runner's own --threads 1 comes first: argparse keeps the last value.
    done = subprocess.run(
        [sys.executable, "train.py", *runner.args("bounds", "--threads", "100000"), "-e", "1"],
        cwd=REPO_ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "--threads 100000 is more than 4 per CPU" in one_error_line(done.stderr)
    assert not runner.checkpoint_dir.exists()


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--base-channels", "100000"], "--base-channels 100000 makes a UNet of 7.57e+13 weights"),
        (["--num-workers", "100000"], "--num-workers 100000 would start 100000 loader processes"),
    ],
)
def test_train_refuses_what_the_machine_cannot_build_before_creating_the_run_folder(
    runner: TrainRunner, capsys: pytest.CaptureFixture, extra: list[str], expected: str
) -> None:
    # In this process (the exit status and line of a process are the --threads case's): refused before the model or
    # a loader worker exists, as the absent run folder shows.
    assert runner.main("bounds", *extra, "-e", "1") == 2
    assert expected in one_error_line(capsys.readouterr().err)
    assert not runner.checkpoint_dir.exists()


def test_the_bound_allows_what_trains(runner: TrainRunner) -> None:
    """Control: the bounds stop only the absurd; a run at the bound itself is accepted."""
    cpus = available_cpus()
    assert runner.main("ok", "-e", "1", "--max-steps", "1", "--threads", str(4 * cpus), "--num-workers", "0") == 0
    assert (runner.run_dir("ok") / "last.pth").is_file()


def test_the_parameter_count_is_the_models(monkeypatch: pytest.MonkeyPatch) -> None:
    # The model counted on the meta device is the one train.py builds: its count, in the message of a machine too small.
    model = tiny_unet()
    count = sum(tensor.numel() for tensor in [*model.parameters(), *model.buffers()])
    monkeypatch.setattr(hardware, "memory_bytes", lambda: 4 * count - 1)
    with pytest.raises(ConfigError, match=re.escape(f"--base-channels 8 makes a UNet of {count:.3g} weights")):
        hardware.check_model_fits(UNetArgs(3, 2, base_channels=8))
    monkeypatch.setattr(hardware, "memory_bytes", lambda: 4 * count)
    hardware.check_model_fits(UNetArgs(3, 2, base_channels=8))


def test_the_memory_bound_is_the_least_of_the_machine_the_cgroup_and_the_address_space(monkeypatch) -> None:
    # On a machine of more than 4 GiB (unknown files read as unreadable).
    gib = 2**30
    files = {"/proc/meminfo": 6 * gib, "/sys/fs/cgroup/memory.max": 4 * gib, "/sys/fs/cgroup/memory.current": gib}
    monkeypatch.setattr(hardware, "_number", lambda path, field=None: files.get(path))
    assert hardware.memory_bytes(free=True) == 3 * gib  # the cgroup's limit less its use
    assert hardware.memory_bytes() == 4 * gib  # the cgroup's limit (this machine has more RAM)
    files["/sys/fs/cgroup/memory.current"] = None  # its use unknown: the cgroup tells nothing free
    assert hardware.memory_bytes(free=True) == 6 * gib  # MemAvailable
    files["/proc/self/status"] = gib
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (5 * gib, resource.RLIM_INFINITY))
    assert hardware.memory_bytes(free=True) == 4 * gib  # ulimit -v less what this process maps


@pytest.mark.parametrize("script", ["predict", "evaluate"])
def test_inference_refuses_absurd_workers(
    script: str, carvana_data: SyntheticData, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    checkpoint = save_checkpoint(tmp_path / "model.pth", tiny_unet(), (0, 1))
    too_many = str(max(MIN_WORKERS_BOUND, WORKERS_PER_CPU * available_cpus()) + 1)
    if script == "predict":
        import predict

        code = predict.main(["-m", str(checkpoint), "-i", str(carvana_data.imgs), "--output-dir",
                             str(tmp_path / "out"), "-j", too_many])  # fmt: skip
    else:
        import evaluate

        code = evaluate.main(["-m", str(checkpoint), "--imgs", str(carvana_data.imgs), "--masks",
                              str(carvana_data.masks), "-j", too_many])  # fmt: skip
    assert code == 2
    assert f"--workers {too_many} would start" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()
