"""Error lines name the program as the user started it: ``unet-train`` for the installed command."""

from __future__ import annotations

import re
import sys

import pytest

from utils.errors import ConfigError
from utils.flags import FlagParser
from utils.inference.config import PredictConfig


@pytest.mark.parametrize(
    ("prog", "argv0", "command"),
    [
        ("train.py", "/home/me/.venv/bin/unet-train", "unet-train"),
        ("train.py", "train.py", "python train.py"),
        ("predict.py", "/repo/predict.py", "python predict.py"),
        ("python -m utils.datasets.check", "/repo/utils/datasets/check.py", "python -m utils.datasets.check"),
    ],
)
def test_the_error_line_names_the_program_as_it_was_started(monkeypatch, prog, argv0, command):
    monkeypatch.setattr(sys, "argv", [argv0])
    with pytest.raises(ConfigError, match=re.escape(f"bad flag (see {command} --help)")):
        FlagParser(PredictConfig, prog=prog).error("bad flag")


def test_an_installed_command_names_itself_in_its_error_line(monkeypatch, capsys):
    # The console script's wrapper: sys.argv[0] is the command's path, then train.main() runs (here, in this process;
    # the installed command itself runs in tests/test_install.py).
    import train

    monkeypatch.setattr(sys, "argv", ["/venv/bin/unet-train"])
    assert train.main(["--epoch", "2"]) == 2
    err = capsys.readouterr().err
    assert err.strip().endswith("did you mean --epochs? (see unet-train --help)"), err
