"""``pip install .`` works and its console commands run the same ``main()``s as ``python train.py`` & co.

The project is installed (without dependencies, no network: the test environment already has them) from a copy of
its sources into a temporary ``--target``, and the commands are run from another folder, so that what they import is
the installed copy and not this checkout.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, child_env
from tests.helpers import one_error_line
from utils.errors import USER_ERROR_EXIT_CODE

COMMANDS = {"unet-train": "train.py", "unet-predict": "predict.py", "unet-evaluate": "evaluate.py"}
# What a source distribution carries; everything else (tests, scripts, data, run folders) stays out of the install.
SOURCES = ("pyproject.toml", "README.md", "requirements.txt", "train.py", "predict.py", "evaluate.py", "unet", "utils")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source, target = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("target")
    for name in SOURCES:
        path = REPO_ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, source / name)
    if (REPO_ROOT / "LICENSE").exists():
        shutil.copy2(REPO_ROOT / "LICENSE", source / "LICENSE")
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
    result = subprocess.run([*command, "--target", str(target), str(source)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return target


def _run(target: Path, command: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    # The scripts' "#!" line names this interpreter; run them through it explicitly so the test needs no exec bit.
    return subprocess.run(
        [sys.executable, str(target / "bin" / command), *args],
        cwd=cwd,
        env=child_env({"PYTHONPATH": str(target)}),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_install_has_the_packages_and_the_three_commands_only(installed: Path) -> None:
    assert sorted(path.name for path in (installed / "bin").iterdir()) == sorted(COMMANDS)
    for package in (
        "unet",
        "utils",
        "utils/training",
        "utils/inference",
        "utils/datasets",
    ):
        assert (installed / package / "__init__.py").is_file(), package
    for script in COMMANDS.values():
        assert (installed / script).is_file(), script
    assert not (installed / "tests").exists() and not (installed / "scripts").exists()


@pytest.mark.slow
def test_each_installed_command_runs_its_script_main(installed: Path, tmp_path: Path) -> None:
    for command in COMMANDS:
        result = _run(installed, command, "--help", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("usage: "), result.stdout
        assert "--help" in result.stdout
    # The installed copy ran, not this checkout (the commands ran in an empty folder, outside the repository). One
    # interpreter imports the three scripts' modules, as the commands do: each import costs seconds (torch).
    imported = ", ".join([*(script.removesuffix(".py") for script in COMMANDS.values()), "utils"])
    probe = subprocess.run(
        [sys.executable, "-c", f"import {imported}; print(*(m.__file__ for m in ({imported})), sep='\\n')"],
        cwd=tmp_path,
        env=child_env({"PYTHONPATH": str(installed)}),
        capture_output=True,
        text=True,
    )
    assert [Path(line).parent.resolve() for line in probe.stdout.split()] == [
        *[installed.resolve()] * len(COMMANDS),
        (installed / "utils").resolve(),
    ], probe.stderr
    # The same error handling as python train.py: one Error: line and exit status 2, with the flag's suggestion.
    result = _run(installed, "unet-train", "--epoch", "1", cwd=tmp_path)
    assert result.returncode == USER_ERROR_EXIT_CODE
    assert "did you mean --epochs?" in one_error_line(result.stderr)
