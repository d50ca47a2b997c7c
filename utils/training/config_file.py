"""Training flags in a YAML file: ``<run>/config.yaml`` records a run's resolved flags, ``--config FILE`` reads them.

The file's keys are the flag names as ``TrainConfig`` spells its fields (``batch_size``; ``batch-size`` is accepted
too), its values the flags' values; every run writes one, so a run can be read, edited and started again:

    python train.py --config checkpoints/unet/config.yaml --exp_name again

The order of precedence is: the command line, then the file, then the defaults. A key that is not a flag is refused
with the closest real name, as an unknown flag is. Each value is read by the command line's own parser, as the flag
would give it (``batch_size: 3`` as ``--batch-size=3``; a switch that is true as the flag, a list as the flag
repeated, null as no flag where the flag has no default), so it gets the command line's checks of type, choices and
range, and a refusal names the file and the key. The rules between flags are checked afterwards by
``validate_config``, for file and command line alike. Switches (``--amp``) can only be turned on from the command line:
to turn off one the file sets, edit the file. A file value the command line overrides is said in one line, and is
still checked (``scale: 5`` is refused even under ``--scale 0.5``): the file is meant to be rerun.

The file is untrusted input, read once here with bounds before any value is built: at most ``MAX_CONFIG_BYTES``,
UTF-8, one document, a flat mapping (a value is a scalar or a list of scalars) without anchors or aliases (a 462-byte
alias bomb expands to gigabytes), no key given twice.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from utils.checkpoint.files import write_run_text
from utils.errors import ConfigError, shortened
from utils.flags import FlagField, FlagParser, did_you_mean, flag_fields
from utils.output_files import read_text

logger = logging.getLogger(__name__)

CONFIG_FLAG = "--config"
CONFIG_DEST = "config_file"
HEADER = (
    "# The resolved flags of this run (keys: train.py's flags). Rerun or vary it with\n"
    "#   python train.py --config {path} --exp_name NEW_NAME [more flags]\n"
)
# A run's config.yaml is about 3 KB: this bound leaves room for any edit.
MAX_CONFIG_BYTES = 1 << 20


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    """``--config FILE``, apart from ``TrainConfig``'s flags: a run's config.yaml does not name itself."""
    help_text = "Read flags from a YAML file (a run's config.yaml); flags on the command line override it"
    parser.add_argument(CONFIG_FLAG, dest=CONFIG_DEST, metavar="FILE", help=help_text)


def apply_config_file(parser: FlagParser, argv: Sequence[str] | None) -> dict[str, Any]:
    """The flags ``argv`` gives (``FlagParser.given_flags``) over those of the file its ``--config`` names, as
    ``parser.config_class`` field values; a flag in neither takes its default."""
    given = parser.given_flags(argv)
    path = given.pop(CONFIG_DEST, None)
    if path is None:
        return given
    from_file = read_config_file(Path(path), parser)
    overridden = [
        f"{key} {shortened(from_file[key])} -> {shortened(value)}"
        for key, value in given.items()
        if key in from_file and from_file[key] != value
    ]
    if overridden:
        logger.warning("%s %s: the command line overrides %s", CONFIG_FLAG, path, ", ".join(overridden))
    return {**from_file, **given}


def read_config_file(path: Path, parser: FlagParser) -> dict[str, Any]:
    """The flags in ``path``, each parsed by ``parser`` as the command line's are, as ``parser.config_class`` field
    values; ConfigError naming the file (and the key)."""
    where = f"{CONFIG_FLAG} {path}"
    text = read_text(path, where, MAX_CONFIG_BYTES, f"{MAX_CONFIG_BYTES // 1024} KiB; a run's config.yaml is a few KB")
    loader = _FlatLoader(text)
    try:
        document = loader.get_single_data()
    except yaml.YAMLError as error:
        raise ConfigError(f"{where} is not valid YAML: {' '.join(str(error).split())}") from None
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None
    finally:
        loader.dispose()
    if document is None:
        return {}
    if not isinstance(document, Mapping):
        raise ConfigError(f"{where} must map flag names to values (like a run's config.yaml)")
    fields = {item.dest: item for item in flag_fields(parser.config_class)}
    values: dict[str, Any] = {}
    for key, value in document.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            raise ConfigError(
                f"{where}: unknown key {shortened(key)}{did_you_mean(name, fields)} (keys are train.py's flag names)"
            )
        try:
            values.update(parser.given_flags(_as_arguments(fields[name], value)))
        except ConfigError as error:
            raise ConfigError(f"{where}: {key}: {error}") from None
    return values


def _as_arguments(item: FlagField, value: Any) -> list[str]:
    """A file's ``value`` as the command line would give the flag ``item``."""
    flag_name = item.flag.name
    if item.kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"must be true or false, got {shortened(value)}")
        return [flag_name] if value else []
    if value is None:
        if item.default is None:
            return []
        raise ConfigError(f"may not be empty (null); remove the key to take the default {shortened(item.default)}")
    if isinstance(value, list) and not item.repeatable:
        raise ConfigError(f"takes one value, got the list {shortened(value)}")
    # "--flag=value": a value that starts with "-" is still the flag's (--weight-decay=-1e-4)
    return [f"{flag_name}={one}" for one in (value if isinstance(value, list) else [value])]


class _FlatLoader(yaml.SafeLoader):
    """PyYAML's safe loader for what a config file holds, a flat mapping, checked on each node before it is composed
    (so nothing refused is ever built): no anchor or alias, no value nested deeper than a list, no key given twice."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.keys: set[str] = set()

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        line = f"(line {event.start_mark.line + 1})"
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise ConfigError(f"has an anchor or alias (& or *), which a config file does not need {line}")
        if isinstance(event, yaml.CollectionStartEvent) and parent is not None:
            if isinstance(event, yaml.MappingStartEvent) or isinstance(parent, yaml.SequenceNode):
                raise ConfigError(f"a value nests deeper than a list of values {line}")
        if isinstance(parent, yaml.MappingNode) and index is None and isinstance(event, yaml.ScalarEvent):
            if event.value in self.keys:  # a key: the mapping's values are composed with their key as index
                raise ConfigError(f"key {shortened(event.value)} is given twice {line}")
            self.keys.add(event.value)
        return super().compose_node(parent, index)


def write_config_file(path: Path, run_args: Mapping[str, Any], summary: str = "") -> None:
    """Write ``run_args`` (a ``TrainConfig.as_dict()``) to ``path`` as YAML, as the run folder's other files are
    written; ``summary`` (the run's changed settings) goes above them as comment lines."""
    comments = "".join(f"# {line}\n" for line in summary.splitlines())
    flags = yaml.safe_dump(dict(run_args), sort_keys=False, default_flow_style=False)
    text = HEADER.format(path=path) + comments + flags
    write_run_text(path, text)
