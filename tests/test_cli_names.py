"""Error lines name the program as the user started it: ``unet-train`` for the installed command."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO_ROOT, child_env
from utils.flags import command_name


def test_command_name_follows_how_the_program_was_started():
    assert command_name("train.py", "/home/me/.venv/bin/unet-train") == "unet-train"
    assert command_name("train.py", "train.py") == "python train.py"
    assert command_name("predict.py", "/repo/predict.py") == "python predict.py"
    assert command_name("python -m utils.datasets.check", "/repo/utils/datasets/check.py") == (
        "python -m utils.datasets.check"
    )


def test_an_installed_command_names_itself_in_its_error_line():
    # The console script's wrapper: sys.argv[0] is the command's path, then train.main() runs.
    code = "import sys, train; sys.argv[0] = '/venv/bin/unet-train'; sys.exit(train.main(['--epoch', '2']))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().endswith("did you mean --epochs? (see unet-train --help)"), result.stderr
