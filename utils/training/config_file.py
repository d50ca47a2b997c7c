"""Training flags in a YAML file: ``<run>/config.yaml`` records a run's resolved flags, ``--config FILE`` reads them.

The file's keys are the flag names as ``TrainConfig`` spells its fields (``batch_size``; ``batch-size`` is accepted
too), its values the flags' values; every run writes one, so a run can be read, edited and started again:

    python train.py --config checkpoints/unet/config.yaml --exp_name again

The order of precedence is: the command line, then the file, then the defaults. A key that is not a flag is refused
with the closest real name, as an unknown flag is; a value of the wrong type is refused naming the file and the key.
Ranges and the rules between flags are checked afterwards by ``validate_config``, for file and command line alike.
Switches (``--amp``) can only be turned on from the command line: to turn off one the file sets, edit the file.
A file value the command line overrides is said in one line, and is still checked (``scale: 5`` is refused even
under ``--scale 0.5``): the file is meant to be rerun.

The file is untrusted input, read once here with bounds before any value is built: at most ``MAX_CONFIG_BYTES``,
UTF-8, one document, nesting at most ``MAX_DEPTH`` deep, at most ``MAX_NODES`` values once its aliases are expanded
(a 462-byte alias bomb expands to gigabytes), no alias that contains itself, no key given twice.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from utils.errors import ConfigError, shortened
from utils.flags import FlagField, build_config, check_ranges, did_you_mean, flag, flag_fields
from utils.output_files import read_text, write_text

logger = logging.getLogger(__name__)

CONFIG_FLAG = "--config"
CONFIG_DEST = "config_file"  # ConfigFileFlag's field
HEADER = (
    "# The resolved flags of this run (keys: train.py's flags). Rerun or vary it with\n"
    "#   python train.py --config {path} --exp_name NEW_NAME [more flags]\n"
)
# A run's config.yaml is about 3 KB, flat (a key, a value or a short list): these bounds leave room for any edit.
MAX_CONFIG_BYTES = 1 << 20
MAX_DEPTH = 16
MAX_NODES = 100_000


@dataclass
class ConfigFileFlag:
    """``--config FILE`` (``utils.flags``), apart from ``TrainConfig``: a run's config.yaml does not name itself."""

    config_file: str | None = flag(None, CONFIG_FLAG, metavar="FILE")
    """Read flags from a YAML file (a run's config.yaml); flags on the command line override it"""


def apply_config_file(given: Mapping[str, Any], config_class: type) -> dict[str, Any]:
    """The flags the command line ``given`` (``utils.flags.given_flags``) over the file of ``given[CONFIG_DEST]``.

    Returns ``config_class`` field values (``CONFIG_DEST`` removed); a flag in neither takes its default.
    """
    given = dict(given)
    path = given.pop(CONFIG_DEST, None)
    if path is None:
        return given
    from_file = read_config_file(Path(path), config_class)
    overridden = [
        f"{key} {shortened(from_file[key])} -> {shortened(value)}"
        for key, value in given.items()
        if key in from_file and from_file[key] != value
    ]
    if overridden:
        logger.warning("%s %s: the command line overrides %s", CONFIG_FLAG, path, ", ".join(overridden))
    return {**from_file, **given}


def read_config_file(path: Path, config_class: type) -> dict[str, Any]:
    """The flags in ``path`` as ``config_class`` field values, type- and range-checked; ConfigError naming the file."""
    document = _read_yaml(path)
    if document is None:
        return {}
    if not isinstance(document, Mapping):
        raise ConfigError(f"{CONFIG_FLAG} {path} must map flag names to values (like a run's config.yaml)")
    fields = {item.dest: item for item in flag_fields(config_class)}
    values: dict[str, Any] = {}
    for key, value in document.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            raise ConfigError(
                f"{CONFIG_FLAG} {path}: unknown key {shortened(key)}{did_you_mean(name, fields)} (keys are train.py's "
                "flag names)"
            )
        values[name] = _checked_value(fields[name], value, f"{CONFIG_FLAG} {path}: {key}")
    try:
        # The file's own values in their ranges, whatever the command line overrides (the file is meant to be rerun).
        check_ranges(build_config(config_class, values))
    except ConfigError as error:
        raise ConfigError(f"{CONFIG_FLAG} {path}: {error}; fix the file") from None
    return values


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a key given twice instead of keeping the last value."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        self.flatten_mapping(node)
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str | int | float | bool):
                continue  # not a flag name: refused as an unknown key after construction
            if key in seen:
                raise ConfigError(f"key {shortened(key)} is given twice (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> Any:
    """The document of ``path``, bounded in size, depth and expanded values before anything is built."""
    where = f"{CONFIG_FLAG} {path}"
    text = read_text(path, where, MAX_CONFIG_BYTES, f"{MAX_CONFIG_BYTES // 1024} KiB; a run's config.yaml is a few KB")
    loader = _BoundedLoader(text)
    try:
        _check_depth(loader)
        loader = _BoundedLoader(text)  # the events were consumed: compose from the start
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expanded_size(node)
        return loader.construct_document(node)
    except yaml.YAMLError as error:
        raise ConfigError(f"{where} is not valid YAML: {' '.join(str(error).split())}") from None
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}; fix the file") from None
    finally:
        loader.dispose()


def _check_depth(loader: yaml.SafeLoader) -> None:
    # On the parser's events, which need no recursion: composing 20,000 nested lists would be a RecursionError.
    depth = 0
    while loader.check_event():
        event = loader.get_event()
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise ConfigError(f"values nest more than {MAX_DEPTH} deep (line {event.start_mark.line + 1})")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _check_expanded_size(root: yaml.Node) -> None:
    """Refuse a node graph (an alias is the node it names) of more than MAX_NODES values expanded, or with a cycle.

    Counted on the composed nodes, where an alias is one shared node, iteratively (aliases can nest deeper than the
    text): the expanded value is never built.
    """
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        children = _children(node)
        if children_done:
            open_nodes.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in children)
            if sizes[id(node)] > MAX_NODES:
                raise ConfigError(
                    f"its aliases expand to more than {MAX_NODES} values (line {node.start_mark.line + 1})"
                )
            continue
        if id(node) in open_nodes:
            raise ConfigError(f"an alias contains itself (line {node.start_mark.line + 1})")
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in sizes)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def write_config_file(path: Path, run_args: Mapping[str, Any], summary: str = "") -> None:
    """Write ``run_args`` (a ``TrainConfig.as_dict()``) to ``path`` as YAML, all or nothing (``output_files``);
    ``summary`` (the run's changed settings) goes above them as comment lines."""
    comments = "".join(f"# {line}\n" for line in summary.splitlines())
    flags = yaml.safe_dump(dict(run_args), sort_keys=False, default_flow_style=False)
    text = HEADER.format(path=path) + comments + flags
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, text, "the run's config.yaml")


def _checked_value(item: FlagField, value: Any, where: str) -> Any:
    if value is None:
        if item.default is None:
            return None
        raise ConfigError(
            f"{where} may not be empty (null); remove the key to take the default {shortened(item.default)}"
        )
    if item.repeatable:
        values = value if isinstance(value, list) else [value]
        return [_checked_scalar(item, one, where) for one in values]
    return _checked_scalar(item, value, where)


def _checked_scalar(item: FlagField, value: Any, where: str) -> Any:
    kind = item.kind
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {shortened(value)}")
        return value
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{where} must be a whole number, got {shortened(value)}")
    if kind is float:
        # YAML 1.1 reads 1e-5 (no dot) as text: a number written that way is still the number meant.
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where} must be a number, got {shortened(value)}")
        value = float(value)
    if kind is str and not isinstance(value, str):
        raise ConfigError(f"{where} must be text, got {shortened(value)} (put it in quotes)")
    if item.flag.choices is not None and value not in item.flag.choices:
        raise ConfigError(f"{where} must be one of {', '.join(item.flag.choices)}, got {shortened(value)}")
    if item.flag.value_type is not None:
        try:
            value = item.flag.value_type(value)
        except (argparse.ArgumentTypeError, ValueError) as error:
            raise ConfigError(f"{where}: {error}") from error
    return value
