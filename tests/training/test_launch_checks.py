"""Launch values are checked before anything waits: a rank out of range or an unresolvable rendezvous host is one
line at once (a process that waited would be killed by the timeout below, the default --dist-timeout being 30 min),
and a rendezvous that fails prints no C++ stack frames."""

from __future__ import annotations

import sys

from tests.conftest import TrainRunner, free_port
from tests.helpers import one_error_line

HANG_GUARD_S = 300  # far below --dist-timeout's 1800 s: a process that waits for its ranks fails the test


def _run(runner: TrainRunner, *flags: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    process = runner.popen([sys.executable], "launch", "--epochs", "1", "--ddp_mode", *flags, env=env)
    try:
        _, err = process.communicate(timeout=HANG_GUARD_S)
    finally:
        process.kill()
    return process.returncode, err


SLURM = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "localhost", "SLURM_LOCALID": "0"}


def test_a_slurm_rank_out_of_range_is_one_line_at_once(runner: TrainRunner) -> None:
    # One rank through the real script; a rank below 0 takes the same check (train.main below, and the environment
    # alone in tests/test_distributed.py).
    code, err = _run(runner, env={**SLURM, "SLURM_PROCID": "5", "SLURM_NTASKS": "2"})
    assert code == 2, err
    assert "SLURM_PROCID=5 is outside 0..1" in one_error_line(err) and "Traceback" not in err, err


def test_a_negative_slurm_rank_is_one_line(runner: TrainRunner, monkeypatch, capsys) -> None:
    # In this process (the script's exit status and output are the test above's): d0209ac raised a ValueError.
    for name, value in {**SLURM, "SLURM_PROCID": "-1", "SLURM_NTASKS": "2"}.items():
        monkeypatch.setenv(name, value)
    assert runner.main("launch", "--epochs", "1", "--ddp_mode") == 2
    assert "SLURM_PROCID=-1 is outside 0..1" in one_error_line(capsys.readouterr().err)
    assert not runner.checkpoint_dir.exists()


def test_an_unresolvable_dist_url_host_is_one_line_without_waiting(runner: TrainRunner) -> None:
    code, err = _run(runner, "--rank", "1", "--world-size", "2", "--dist-url", "tcp://no-such-host.invalid:29500")
    assert code == 2, err
    line = one_error_line(err)
    assert "'no-such-host.invalid' (from --dist-url) cannot be resolved" in line, err


def test_a_failed_rendezvous_is_one_line_without_cpp_stack_frames(runner: TrainRunner) -> None:
    # Rank 1 alone: nobody listens at the address, as when rank 0 never started or --dist-url names the wrong host.
    url = f"tcp://127.0.0.1:{free_port()}"
    code, err = _run(runner, "--rank", "1", "--world-size", "2", "--dist-url", url, "--dist-timeout", "3")
    assert code == 2, err
    line = one_error_line(err)
    assert f"could not join the other 1 process(es) at {url[len('tcp://') :]}" in line, err
    assert "--dist-url" in line and "--dist-timeout 3" in line, err
    assert "frame #" not in err and "[c10d]" not in err, err
    assert not runner.run_dir("launch").exists()  # it failed before any process group or run folder existed
