"""Error lines name the program as the user started it: ``unet-train`` for the installed command."""

from __future__ import annotations

import sys

from utils.flags import command_name


def test_command_name_follows_how_the_program_was_started():
    assert command_name("train.py", "/home/me/.venv/bin/unet-train") == "unet-train"
    assert command_name("train.py", "train.py") == "python train.py"
    assert command_name("predict.py", "/repo/predict.py") == "python predict.py"
    assert command_name("python -m utils.datasets.check", "/repo/utils/datasets/check.py") == (
        "python -m utils.datasets.check"
    )


def test_an_installed_command_names_itself_in_its_error_line(monkeypatch, capsys):
    # The console script's wrapper: sys.argv[0] is the command's path, then train.main() runs (here, in this process;
    # the installed command itself runs in tests/test_install.py).
    import train

    monkeypatch.setattr(sys, "argv", ["/venv/bin/unet-train"])
    assert train.main(["--epoch", "2"]) == 2
    err = capsys.readouterr().err
    assert err.strip().endswith("did you mean --epochs? (see unet-train --help)"), err
