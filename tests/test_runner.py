"""run_main (utils.launch.process_group): the scripts' one way out (exit status and one line); the shared --device."""

from __future__ import annotations

import argparse
import logging
import warnings

import pytest
import torch

from utils.cli import device_flag, setup_logging
from utils.errors import ConfigError
from utils.launch.process_group import RunStage, run_main
from utils.training.config import parse_config


def raising(error: BaseException):
    def body() -> int:
        raise error

    return body


@pytest.mark.parametrize(
    ("error", "status", "line"),
    [
        (ConfigError("--scale must be in (0, 1]"), 2, "Error: --scale must be in (0, 1]"),
        (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried"), 2, "Error: CUDA ran out of memory; lower --x"),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory"), 2, "Error: the CPU ran out of memory; lower --x"),
        (MemoryError(), 2, "Error: the CPU ran out of memory; lower --x"),
        (RuntimeError("[gloo] Connection closed by peer"), 1, "Error: lost contact with another training process"),
        (KeyboardInterrupt(), 130, "Error: stopped by SIGINT"),
    ],
)
def test_each_error_is_one_line_and_its_status(error, status, line, capsys) -> None:
    assert run_main(raising(error), oom_fix="lower --x") == status
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(line), err


def test_a_bug_keeps_its_traceback() -> None:
    with pytest.raises(RuntimeError, match="a bug"):
        run_main(raising(RuntimeError("a bug")), oom_fix="lower --x")


def test_help_and_argparse_statuses_pass_through() -> None:
    assert run_main(raising(SystemExit(0)), oom_fix="") == 0
    assert run_main(raising(SystemExit(2)), oom_fix="") == 2


def test_a_shared_user_error_is_printed_by_rank_0_only(capsys, monkeypatch) -> None:
    monkeypatch.setattr("utils.launch.process_group.QUIET_EXIT_BEFORE_JOINING_S", 0.0)
    assert run_main(raising(ConfigError("bad flag")), oom_fix="", stage=RunStage(rank=1)) == 2
    assert capsys.readouterr().err == ""
    # While joining, the error is this rank's own: it prints it.
    assert run_main(raising(ConfigError("no peer")), oom_fix="", stage=RunStage(rank=1, joining=True)) == 2
    assert capsys.readouterr().err == "Error: no peer\n"


def test_ranks_other_than_0_log_errors_only() -> None:
    root = logging.getLogger()
    level = root.level
    try:
        with warnings.catch_warnings():
            setup_logging(rank=1, world_size=2)
            assert root.level == logging.ERROR
            assert warnings.filters[0][0] == "ignore"
        setup_logging(rank=0, world_size=2)
        assert root.level == logging.INFO
    finally:
        root.setLevel(level)


@pytest.mark.parametrize("text", ["auto", "cpu", "cuda", "cuda:1", "mps"])
def test_device_is_spelled_the_same_in_every_script(text: str) -> None:
    assert device_flag(text) == text
    assert parse_config(["--device", text]).performance.device == text


@pytest.mark.parametrize("text", ["gpu", "cuda:", "cuda:x", "xla"])
def test_a_misspelled_device_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="is not a device"):
        device_flag(text)
    with pytest.raises(ConfigError, match="argument --device"):
        parse_config(["--device", text])
