"""How a config field becomes a command-line flag: declared once, beside the field, and read by argparse and checks.

A field of ``TrainConfig`` is declared as ``epochs: int = flag(5, "--epochs", "-e", group=..., help=...,
range=Range(1))``: its name, type (the annotation), default, spellings, help group, help text and allowed range are in
that one line. ``add_flags`` makes the argparse arguments from the fields, ``check_ranges`` the range errors, and the
flags table of docs/TRAINING.md is tested against the same fields (``tests/test_readme_flags.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from utils.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """The values a number may take; the error names the flag, the bounds and the value.

    Floats must also be finite. ``note`` follows the bounds in the message (" seconds", " (0 = off)"); ``zero`` says
    what 0 means for a count whose 0 is a setting ("--keep-last must be 0 (keep all) or positive"); ``what`` names the
    kind of value for a bounded integer ("a mask value").
    """

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    note: str = ""
    zero: str = ""
    what: str = ""


@dataclass(frozen=True)
class Flag:
    """The command-line side of one config field (its name, type and default are the field's)."""

    names: tuple[str, ...]
    group: str
    help: str
    range: Range | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    const: str | None = None
    """The value of the flag given without one (``--resume`` alone means ``auto``)."""
    value_type: Callable[[str], Any] | None = None
    """A parser for the value other than the annotation's type (``--device``)."""

    @property
    def name(self) -> str:
        """The spelling error messages use."""
        return self.names[0]


def flag(default: Any, *names: str, group: str, help: str, **options: Any) -> Any:
    """A dataclass field with ``default`` that is the flag ``names`` (``options``: the other ``Flag`` fields)."""
    record = Flag(names=names, group=group, help=help, **options)
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={"flag": record})
    return dataclasses.field(default=default, metadata={"flag": record})


@dataclass(frozen=True)
class FlagField:
    """One flag with what its field says: destination, value type and default."""

    dest: str
    kind: type
    """int, float, str or bool; for a repeatable flag the type of one value."""
    repeatable: bool
    default: Any
    flag: Flag


def flag_fields(config_class: type) -> Iterator[FlagField]:
    """The flags of ``config_class`` (a dataclass whose fields were declared with ``flag``), in field order."""
    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        record = field.metadata.get("flag")
        if record is None:
            continue
        kind, repeatable = _value_type(hints[field.name])
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        yield FlagField(field.name, kind, repeatable, default, record)


def _value_type(hint: Any) -> tuple[type, bool]:
    """``int | None`` -> (int, False); ``list[int]`` -> (int, True)."""
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], True
    args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return (args[0] if args else hint), False


def add_flags(parser: argparse.ArgumentParser, config_class: type, groups: tuple[str, ...]) -> None:
    """Add every flag of ``config_class`` to ``parser``, each under its help group (in the order of ``groups``)."""
    sections = {name: parser.add_argument_group(name) for name in groups}
    for item in flag_fields(config_class):
        record = item.flag
        options: dict[str, Any] = {"dest": item.dest, "help": record.help}
        if item.kind is bool:
            options["action"] = "store_true"
        else:
            options["type"] = record.value_type or item.kind
            options["default"] = item.default
            if item.repeatable:
                options["action"] = "append"
            if record.choices is not None:
                options["choices"] = record.choices
            if record.metavar is not None:
                options["metavar"] = record.metavar
            if record.const is not None:
                options["nargs"], options["const"] = "?", record.const
        sections[record.group].add_argument(*record.names, **options)


def check_ranges(config: Any) -> None:
    """Every value of ``config`` inside its flag's ``Range``, else one ``ConfigError`` naming the flag."""
    for item in flag_fields(type(config)):
        if item.flag.range is None:
            continue
        value = getattr(config, item.dest)
        for one in value if item.repeatable else [value]:
            if one is None:
                continue
            if item.kind is float:
                require_number(one, item.flag.name, item.flag.range)
            else:
                _require_count(one, item.flag.name, item.flag.range)


def require_number(value: float, flag_name: str, bounds: Range) -> None:
    """``value`` is finite and inside ``bounds``, else one error naming the flag, the interval and the value."""
    low, high = bounds.low, bounds.high
    above_low = value > low if bounds.low_open else value >= low
    below_high = value < high if bounds.high_open else value <= high
    if math.isfinite(value) and above_low and below_high:
        return
    if math.isinf(high):
        where = f"{'above' if bounds.low_open else 'at least'} {low:g}"
    else:
        where = f"in {'(' if bounds.low_open else '['}{low:g}, {high:g}{')' if bounds.high_open else ']'}"
    raise ConfigError(f"{flag_name} must be a finite number {where}{bounds.note}, got {value:g}")


def _require_count(value: int, flag_name: str, bounds: Range) -> None:
    if bounds.low <= value <= bounds.high:
        return
    low, high = int(bounds.low), bounds.high
    if not math.isinf(high):
        what = f"{bounds.what} " if bounds.what else ""
        raise ConfigError(f"{flag_name} must be {what}in {low}..{int(high)}, got {value}")
    if bounds.zero:
        raise ConfigError(f"{flag_name} must be 0 ({bounds.zero}) or positive")
    if low == 0:
        raise ConfigError(f"{flag_name} must not be negative, got {value}")
    raise ConfigError(f"{flag_name} must be at least {low}{bounds.note}")
