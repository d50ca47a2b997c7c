"""Ctrl-C while an entry script is still importing torch: exit 130 and one line, not a traceback through torch's
imports; once the imports are over, predict.py and evaluate.py give SIGINT back to Python (``run_main`` of
utils.launch.process_group reports it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, child_env
from tests.helpers import fake_scontrol
from utils.launch.signals import startup_done, stop_quietly_while_starting


def _importing_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _sigint_as_from_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _command(script: str, tmp_path: Path) -> list[str]:
    """Flags that would write into tmp_path/out, had the script got that far."""
    out = tmp_path / "out"
    if script == "train.py":
        return [script, "--checkpoint-dir", str(out)]
    if script == "predict.py":
        return [script, "-m", str(tmp_path / "model.pth"), "-i", str(tmp_path / "a.png"), "--output-dir", str(out)]
    return [script, "-m", str(tmp_path / "model.pth"), "--imgs", str(tmp_path), "--masks", str(tmp_path),
            "--json", str(out / "scores.json")]  # fmt: skip


@pytest.mark.parametrize("script", ["train.py", "predict.py", "evaluate.py"])
def test_ctrl_c_during_startup_exits_130_with_one_line(tmp_path: Path, script: str) -> None:
    process = subprocess.Popen(
        [sys.executable, *_command(script, tmp_path)],
        cwd=REPO_ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # As from a terminal: a test runner's worker (pytest-xdist) or a background shell job ignores SIGINT, and a
        # child inherits that, so the script would never see the Ctrl-C this test sends.
        preexec_fn=_sigint_as_from_a_terminal,
    )
    deadline = time.monotonic() + 60
    while not _importing_torch(process.pid) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)  # torch's libraries are being loaded: the imports are under way
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, (process.returncode, err[-3000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: stopped by SIGINT (Ctrl-C)"), err[-3000:]
    assert not (tmp_path / "out").exists()


def test_startup_done_gives_sigint_back_to_python() -> None:
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        stop_quietly_while_starting()
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler  # the start-up handler
        startup_done()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a handler someone else chose is left alone
        startup_done()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_sigterm_during_train_imports_is_remembered_and_saves_at_the_first_step(runner) -> None:
    # SLURM's scancel or --signal can land while torch is imported: the run still stops as for a signal in training.
    process = runner.popen([sys.executable], "early", "--epochs", "1")
    deadline = time.monotonic() + 60
    while not _importing_torch(process.pid) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 143, (process.returncode, err[-3000:])
    assert (runner.run_dir("early") / "INTERRUPTED.pth").is_file(), err[-3000:]
    assert "Stopped by SIGTERM at epoch 1, step 1" in out + err, (out + err)[-3000:]


def test_the_requeue_signal_during_train_imports_saves_and_requeues_the_job(runner, tmp_path: Path) -> None:
    # SLURM's --signal=USR1@N can come while torch is still loading (its resolution is about 30 s): the signal is
    # remembered, the run saves at its first step and requeues the job, instead of dying of SIGUSR1 with nothing saved.
    calls = fake_scontrol(tmp_path / "bin")
    path = f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"
    process = runner.popen([sys.executable], "early", "--epochs", "1", env={"SLURM_JOB_ID": "4242", "PATH": path})
    deadline = time.monotonic() + 60
    while not _importing_torch(process.pid) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGUSR1)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 128 + signal.SIGUSR1, (process.returncode, err[-3000:])
    assert (runner.run_dir("early") / "INTERRUPTED.pth").is_file(), err[-3000:]
    assert "Stopped by SIGUSR1 at epoch 1, step 1" in out + err, (out + err)[-3000:]
    assert calls.read_text().splitlines() == ["requeue 4242"]


def test_signals_after_the_training_are_ignored() -> None:
    # The handlers InterruptFlag gives back once training is over: a late requeue signal or SIGTERM must not turn a
    # finished job into a FAILED one.
    code = (
        "import os, signal\n"
        "from utils.launch.signals import InterruptFlag, catch_signals_from_start\n"
        "catch_signals_from_start()\n"
        "flag = InterruptFlag().install(signal.SIGUSR1)\n"
        "flag.restore()\n"
        "for signum in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):\n"
        "    os.kill(os.getpid(), signum)\n"
        # Python's exit resets handlers it installed to SIG_DFL, not ignored ones: a signal during its finalisation
        # (seconds, with torch loaded) must not kill the finished process either.
        "print('still here', flag.signum, signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=child_env(), capture_output=True,
                          text=True, timeout=60, preexec_fn=_sigint_as_from_a_terminal)  # fmt: skip
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, "still here 0 True", "")


def test_torchruns_sigterm_during_start_up_ends_a_rank_that_leaves_the_error_to_rank_0(tmp_path: Path) -> None:
    """torchrun stops the other ranks with SIGTERM once rank 0 has printed a bad flag and exited; a rank still
    importing then only remembers it, and must not sleep out its wait for that SIGTERM (torchrun's SIGKILL, 30 s
    later, would be reported as "Unable to shutdown process")."""
    from utils.launch import process_group

    env = child_env() | {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "test"}  # fmt: skip
    process = subprocess.Popen(
        [sys.executable, "train.py", "--ddp_mode", "--scale", "0", "--checkpoint-dir", str(tmp_path / "out")],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not _importing_torch(process.pid) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)  # during the imports: the start-up handler remembers it
    # Well inside the wait that a rank without torchrun's SIGTERM keeps before leaving.
    out, err = process.communicate(timeout=process_group.QUIET_EXIT_BEFORE_JOINING_S / 2)
    assert process.returncode == 2, (process.returncode, err[-3000:])
    assert "Error:" not in err, "rank 0 prints the error, not this rank"
    assert not (tmp_path / "out").exists()
