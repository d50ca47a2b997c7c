"""``<run>/config.yaml`` records a run's flags and ``--config FILE`` reads them, under the command line."""

from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

import train
from tests.conftest import load_checkpoint
from tests.helpers import one_error_line
from utils.checkpoint.format import KEY_ARGS
from utils.errors import USER_ERROR_EXIT_CODE, ConfigError
from utils.training.config import TrainConfig, parse_config


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_file_values_apply_and_the_command_line_overrides_them(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "c.yaml",
        "epochs: 7\nbatch-size: 3\nlearning_rate: 1e-4\nignore_values: [255]\namp: true\nexp_name: from-file\n",
    )
    config = parse_config(["--config", str(path), "--epochs", "2", "--ignore-value", "0"])
    assert config.optimisation.epochs == 2  # the command line wins
    assert (
        config.optimisation.batch_size == 3
        and config.performance.amp is True
        and config.checkpoint.exp_name == "from-file"
    )
    assert config.optimisation.learning_rate == pytest.approx(1e-4)  # YAML reads 1e-4 as text: still the number meant
    assert config.data.ignore_values == [0]  # a repeatable flag replaces the file's list, it does not add to it
    # A flag given at its default value is given all the same: it overrides the file's value.
    default = TrainConfig().optimisation.epochs
    assert parse_config(["--config", str(path), "--epochs", str(default)]).optimisation.epochs == default != 7
    # Without the flags, the file's values; without the file, the defaults.
    assert parse_config(["--config", str(path)]).data.ignore_values == [255]
    assert parse_config([]).optimisation.epochs == TrainConfig().optimisation.epochs


def test_unknown_keys_and_wrong_types_are_refused_naming_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.yaml", "epochs: 2\nbatch_sise: 4\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: unknown key 'batch_sise'; did you mean batch_size\?"):
        parse_config(["--config", str(path)])
    for text, message in [
        # Each value is read by the command line's parser, as the flag would give it: the same checks, the same words.
        ("epochs: two\n", r"bad\.yaml: epochs: argument --epochs/-e: invalid int value: 'two'"),
        ("epochs: 2.5\n", r"bad\.yaml: epochs: argument --epochs/-e: invalid int value: '2\.5'"),
        ("amp: 1\n", r"bad\.yaml: amp: must be true or false, got 1"),
        ("optimizer: sgd\n", r"bad\.yaml: optimizer: argument --optimizer: invalid choice: 'sgd'"),
        ("device: gpu\n", r"bad\.yaml: device: argument --device: 'gpu' is not a device"),
        ("scale: null\n", r"bad\.yaml: scale: may not be empty \(null\); remove the key to take the default 0\.5"),
        ("exp_name: [a, b]\n", r"bad\.yaml: exp_name: takes one value, got the list \['a', 'b'\]"),
        ("ignore_values: [1, x]\n", r"bad\.yaml: ignore_values: argument --ignore-value: invalid int value: 'x'"),
        ("- epochs\n", r"must map flag names to values"),
        ("epochs: [\n", r"is not valid YAML"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_config(["--config", str(_write(tmp_path / "bad.yaml", text))])
    with pytest.raises(ConfigError, match=r"--config .*missing\.yaml: cannot read it"):
        parse_config(["--config", str(tmp_path / "missing.yaml")])
    # Ranges are the flags' own, whichever way the value came.
    with pytest.raises(ConfigError, match=r"range\.yaml: scale: --scale must be a finite number in \(0, 1\], got 2$"):
        parse_config(["--config", str(_write(tmp_path / "range.yaml", "scale: 2\n"))])
    with pytest.raises(ConfigError, match=r"range\.yaml: weight_decay: --weight-decay must be .*, got -0\.0001$"):
        parse_config(["--config", str(_write(tmp_path / "range.yaml", "weight_decay: -1.0e-4\n"))])


def test_a_bad_config_file_is_one_error_line_and_exit_2(tmp_path: Path, capsys) -> None:
    path = _write(tmp_path / "c.yaml", "epoch: 2\n")
    assert train.main(["--config", str(path)]) == USER_ERROR_EXIT_CODE
    assert "did you mean epochs?" in one_error_line(capsys.readouterr().err)


def test_a_run_writes_config_yaml_and_rerunning_it_reproduces_the_run(runner, tmp_path: Path) -> None:
    assert runner.main("first", "--epochs", "1", "--ignore-value", "255", "--class-weights", "1,2") == 0
    config_file = runner.run_dir("first") / "config.yaml"
    recorded = yaml.safe_load(config_file.read_text())
    first = load_checkpoint(runner.run_dir("first") / "last.pth")
    assert recorded == first[KEY_ARGS]

    # The file alone (it names the data and the checkpoint folder) and a new name: the same run again.
    try:
        assert train.main(["--config", str(config_file), "--exp_name", "again"]) == 0
    finally:
        torch.use_deterministic_algorithms(False)
    again = load_checkpoint(runner.run_dir("again") / "last.pth")
    assert again[KEY_ARGS] == {**first[KEY_ARGS], "exp_name": "again"}
    # --deterministic on CPU: the rerun trains to the very same weights.
    for key, tensor in first["model_state"].items():
        assert torch.equal(tensor, again["model_state"][key]), key


# A 9-level alias bomb under a real flag: 9 aliases of the level below each, 9**9 (387 million) strings once
# expanded, in about 320 bytes.
_ALIAS_BOMB = (
    'exp_name: [&a ["x","x","x","x","x","x","x","x","x"], '
    + ", ".join(f"&{name} [{','.join([f'*{below}'] * 9)}]" for below, name in zip("abcdefgh", "bcdefghi", strict=True))
    + "]\n"
)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (_ALIAS_BOMB.encode(), r"c\.yaml: has an anchor or alias \(& or \*\), which a config file does not need"),
        (b"a: &a [*a]\n", r"c\.yaml: has an anchor or alias .* \(line 1\)"),
        (b"epochs: " + b"[" * 20_000 + b"]" * 20_000 + b"\n", r"c\.yaml: a value nests deeper than a list of values"),
        (b"epochs: {a: 1}\n", r"c\.yaml: a value nests deeper than a list of values \(line 1\)"),
        ("exp_name: caf\xe9\n".encode("latin-1"), r"c\.yaml is not UTF-8 text \(byte 13\); save it as UTF-8"),
        (b"epochs: 2\nbatch_size: 3\nepochs: 4\n", r"c\.yaml: key 'epochs' is given twice \(line 3\)"),
        (b"# padding\n" * 110_000, r"c\.yaml is larger than 1024 KiB"),
    ],
    ids=["alias-bomb", "self-alias", "deep", "mapping-value", "latin-1", "duplicate-key", "too-large"],
)
def test_hostile_config_files_are_one_error_line(tmp_path: Path, capsys, content: bytes, message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    assert train.main(["--config", str(path)]) == USER_ERROR_EXIT_CODE
    line = one_error_line(capsys.readouterr().err)
    assert re.search(message, line), line
    assert len(line) < 300  # never the expanded value


def test_overridden_file_values_are_said_and_still_checked(tmp_path: Path, caplog) -> None:
    path = _write(tmp_path / "c.yaml", "epochs: 3\nbatch_size: 2\n")
    with caplog.at_level(logging.WARNING, logger="utils.training.config_file"):
        assert parse_config(["--config", str(path), "--epochs", "4", "--batch-size", "2"]).optimisation.epochs == 4
    overrides = [record.getMessage() for record in caplog.records if "overrides" in record.getMessage()]
    assert overrides == [f"--config {path}: the command line overrides epochs 3 -> 4"]
    # The file's own value is refused though the command line sets the flag: the file is meant to be rerun.
    with pytest.raises(ConfigError, match=r"c5\.yaml: scale: --scale must be a finite number in \(0, 1\], got 5"):
        parse_config(["--config", str(_write(tmp_path / "c5.yaml", "scale: 5\n")), "--scale", "0.5"])


def test_config_yaml_goes_through_the_one_writer(tmp_path) -> None:
    """Written all or nothing like every output: a link at the path is replaced, never written through, and an
    unwritable folder is a failed save's one line naming the file and --checkpoint-dir (not an OSError traceback)."""
    from utils.errors import CheckpointError
    from utils.training.config_file import write_config_file

    kept = tmp_path / "input.yaml"
    kept.write_text("mine: 1\n")
    path = tmp_path / "run" / "config.yaml"
    path.parent.mkdir()
    path.symlink_to(kept)
    write_config_file(path, {"epochs": 3})
    assert kept.read_text() == "mine: 1\n" and not path.is_symlink() and "epochs: 3" in path.read_text()
    from tests.helpers import small_tmpfs

    with small_tmpfs(tmp_path / "ro", "1m") as folder:
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        with pytest.raises(CheckpointError, match=r"could not write .*config.yaml: .*--checkpoint-dir"):
            write_config_file(folder / "config.yaml", {"epochs": 3})
