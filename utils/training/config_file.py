"""Training flags in a YAML file: ``<run>/config.yaml`` records a run's resolved flags, ``--config FILE`` reads them.

The file's keys are the flag names as ``TrainConfig`` spells its fields (``batch_size``; ``batch-size`` is accepted
too), its values the flags' values; every run writes one, so a run can be read, edited and started again:

    python train.py --config checkpoints/unet/config.yaml --exp_name again

The order of precedence is: the command line, then the file, then the defaults. A key that is not a flag is refused
with the closest real name, as an unknown flag is; a value of the wrong type is refused naming the file and the key.
Ranges and the rules between flags are checked afterwards by ``validate_config``, for file and command line alike.
Switches (``--amp``) can only be turned on from the command line: to turn off one the file sets, edit the file.
"""

from __future__ import annotations

import argparse
import difflib
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from utils.errors import ConfigError
from utils.flags import FlagField, flag_fields

CONFIG_FLAG = "--config"
CONFIG_DEST = "config_file"
HEADER = (
    "# The resolved flags of this run (keys: train.py's flags). Rerun or vary it with\n"
    "#   python train.py --config {path} --exp_name NEW_NAME [more flags]\n"
)


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    """``--config FILE``; the parser's result keeps it under ``CONFIG_DEST`` (not a TrainConfig field)."""
    parser.add_argument(
        CONFIG_FLAG,
        dest=CONFIG_DEST,
        metavar="FILE",
        default=None,
        help="Read flags from a YAML file (a run's config.yaml); flags on the command line override it",
    )


def apply_config_file(
    parser: argparse.ArgumentParser, argv: Sequence[str], values: dict[str, Any], config_class: type
) -> dict[str, Any]:
    """``values`` (the parser's result for ``argv``) with ``values[CONFIG_DEST]``'s file under the command line.

    Returns the keyword arguments of ``config_class`` (``CONFIG_DEST`` removed).
    """
    values = dict(values)
    path = values.pop(CONFIG_DEST, None)
    if path is None:
        return values
    from_file = read_config_file(Path(path), config_class)
    given = _given_on_command_line(parser, argv)
    given.pop(CONFIG_DEST, None)
    return {**values, **from_file, **given}


def read_config_file(path: Path, config_class: type) -> dict[str, Any]:
    """The flags in ``path`` as ``config_class`` field values, type-checked; ConfigError naming the file otherwise."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"{CONFIG_FLAG} {path}: cannot read it ({error.strerror or error})") from error
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{CONFIG_FLAG} {path} is not valid YAML: {' '.join(str(error).split())}") from error
    if document is None:
        return {}
    if not isinstance(document, Mapping):
        raise ConfigError(f"{CONFIG_FLAG} {path} must map flag names to values (like a run's config.yaml)")
    fields = {item.dest: item for item in flag_fields(config_class)}
    values: dict[str, Any] = {}
    for key, value in document.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            close = difflib.get_close_matches(name, list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"{CONFIG_FLAG} {path}: unknown key {key!r}{hint} (keys are train.py's flag names)")
        values[name] = _checked_value(fields[name], value, f"{CONFIG_FLAG} {path}: {key}")
    return values


def write_config_file(path: Path, run_args: Mapping[str, Any], summary: str = "") -> None:
    """Write ``run_args`` (a ``TrainConfig.as_dict()``) to ``path`` as YAML, atomically (temp file and replace);
    ``summary`` (the run's changed settings) goes above them as comment lines."""
    comments = "".join(f"# {line}\n" for line in summary.splitlines())
    flags = yaml.safe_dump(dict(run_args), sort_keys=False, default_flow_style=False)
    text = HEADER.format(path=path) + comments + flags
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def _given_on_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> dict[str, Any]:
    """Only the flags ``argv`` names, parsed: every default suppressed, so absent flags leave no attribute."""
    saved = [(action, action.default) for action in parser._actions]
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        namespace, _ = parser.parse_known_args(list(argv))
    finally:
        for action, default in saved:
            action.default = default
    return vars(namespace)


def _checked_value(item: FlagField, value: Any, where: str) -> Any:
    if value is None:
        if item.default is None:
            return None
        raise ConfigError(f"{where} may not be empty (null); remove the key to take the default {item.default!r}")
    if item.repeatable:
        values = value if isinstance(value, list) else [value]
        return [_checked_scalar(item, one, where) for one in values]
    return _checked_scalar(item, value, where)


def _checked_scalar(item: FlagField, value: Any, where: str) -> Any:
    kind = item.kind
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{where} must be a whole number, got {value!r}")
    if kind is float:
        # YAML 1.1 reads 1e-5 (no dot) as text: a number written that way is still the number meant.
        if isinstance(value, str):
            value = _number_if_numeric(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        value = float(value)
    if kind is str and not isinstance(value, str):
        raise ConfigError(f"{where} must be text, got {value!r} (put it in quotes)")
    if item.flag.choices is not None and value not in item.flag.choices:
        raise ConfigError(f"{where} must be one of {', '.join(item.flag.choices)}, got {value!r}")
    if item.flag.value_type is not None:
        try:
            value = item.flag.value_type(value)
        except (argparse.ArgumentTypeError, ValueError) as error:
            raise ConfigError(f"{where}: {error}") from error
    return value


def _number_if_numeric(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text
