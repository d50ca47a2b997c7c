"""How a config field becomes a command-line flag: declared once, beside the field, for every entry script.

A field is declared as ``epochs: int = flag(5, "--epochs", "-e", range="[1, inf)")`` followed by its docstring: its
name, type (the annotation), default, spellings and allowed range are in that line, and the docstring is its help
text. A config is either flat (``PredictConfig``) or made of sections (``TrainConfig.optimisation``, declared with
``section``), whose flags are listed under the section's help title. ``FlagParser`` makes the argparse arguments, each
value parsed by argparse and checked against its range (``check_range``); ``build_config`` makes the config from the
flags given (``FlagParser.given_flags``). train.py's flags table in docs/TRAINING.md is tested against the same fields
(``tests/test_readme_flags.py``).

Class names (``train.py --class-names background,car``) are checked here too, once, and recorded in checkpoints for
the legends: a name per class, background first, as ``--class-weights`` counts them (two for ``--classes 1``).
Predict's overlay legends and evaluate's table show them beside the mask values; a checkpoint without names shows the
values alone.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import math
import sys
import textwrap
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from utils.errors import ConfigError

# How a resumed training run treats each flag (utils.training.setup.check_resume_flags), marked on it as ``resume=``.
MUST_MATCH = "must match"
"""The run's value or none: a resume asking for another is refused, naming the flag and ``--load`` (what the loss
measures, which images train and validate, the optimizer's and the averages' state, the model's arguments)."""
MAY_CHANGE = "may change"
"""The default: takes this command's value; a value other than the run's is said in one line at the resume
(``old -> new``)."""
NEW_PLAN = "new plan"
"""How a run starts: a resume keeps the run's recorded plan (another plan is a new run, ``--load``)."""


@dataclass(frozen=True)
class Flag:
    """The command-line side of one config field (its name, type and default are the field's, its help the
    field's docstring)."""

    names: tuple[str, ...]
    range: str | None
    """The interval a number lies in, as ``check_range`` reads it (``"(0, 1]"``, ``"[1, inf)"``)."""
    resume: str
    """How a resumed training run treats the flag: ``MUST_MATCH``, ``MAY_CHANGE`` or ``NEW_PLAN`` (train.py's)."""
    options: Mapping[str, Any]
    """argparse's own options, as given: ``choices``, ``metavar``, ``required``, ``type`` (a parser other than the
    annotation's type, ``--device``), ``nargs`` and ``const`` (``--resume`` alone means ``auto``); a list field with
    ``nargs`` takes its values after one flag (``-i a.jpg b.jpg``) instead of repeating it."""

    @property
    def name(self) -> str:
        """The spelling error messages use."""
        return self.names[0]


def flag(default: Any, *names: str, range: str | None = None, resume: str = MAY_CHANGE, **options: Any) -> Any:
    """A dataclass field with ``default`` that is the flag ``names`` (``options``: argparse's, ``Flag.options``)."""
    record = Flag(names, range, resume, options)
    # Made by a factory, so that no two configs share a list (``--ignore-value``).
    return dataclasses.field(default_factory=lambda: copy.copy(default), metadata={"flag": record})


def section(section_class: type, title: str) -> Any:
    """A field holding ``section_class``, whose flags ``--help`` lists under ``title``."""
    return dataclasses.field(default_factory=section_class, metadata={"section": title})


@dataclass(frozen=True)
class FlagField:
    """One flag with what its field says: destination, value type, default and help."""

    dest: str
    """The field's name, unique across a config's sections: argparse's destination and the flat dict's key."""
    kind: type
    """int, float, str, bool or Path; for a list field the type of one value."""
    repeatable: bool
    default: Any
    flag: Flag
    help: str
    title: str | None = None
    """The help title of the section holding it (``optimisation``), None in a flat config."""


@functools.cache
def flag_fields(config_class: type, title: str | None = None) -> tuple[FlagField, ...]:
    """The flags of ``config_class`` and of its sections, in field order."""
    hints = typing.get_type_hints(config_class)
    docs: dict[str, str] = {}
    for klass in reversed(config_class.__mro__):  # a field declared in a base class has its docstring there
        if dataclasses.is_dataclass(klass):
            docs.update(_field_docstrings(klass))
    items: list[FlagField] = []
    for field in dataclasses.fields(config_class):
        if "section" in field.metadata:
            items += flag_fields(hints[field.name], field.metadata["section"])
        elif "flag" in field.metadata:
            kind, repeatable = _value_type(hints[field.name])
            default, record, help_text = field.default_factory(), field.metadata["flag"], docs[field.name]
            items.append(FlagField(field.name, kind, repeatable, default, record, help_text, title))
    return tuple(items)


def _field_docstrings(config_class: type) -> dict[str, str]:
    """``{field: its docstring on one line}``: the string under each annotated field of the class's source."""
    body = ast.parse(textwrap.dedent(inspect.getsource(config_class))).body[0].body  # type: ignore[attr-defined]
    return {
        # A docstring is a sentence; the help line is not (argparse appends "(default: ...)").
        statement.target.id: " ".join(following.value.value.split()).removesuffix(".")
        for statement, following in zip(body, body[1:], strict=False)
        if isinstance(statement, ast.AnnAssign)
        and isinstance(following, ast.Expr)
        and isinstance(following.value, ast.Constant)
        and isinstance(following.value.value, str)
    }


def _value_type(hint: Any) -> tuple[type, bool]:
    """``int | None`` -> (int, False); ``list[int]`` and ``list[int] | None`` -> (int, True)."""
    if type(None) in typing.get_args(hint):
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], True
    return hint, False


class FlagParser(argparse.ArgumentParser):
    """argparse for every flag of ``config_class``, each section's under its help title; it raises ConfigError
    instead of printing usage and exiting, so every error is one line."""

    def __init__(self, config_class: type, **options: Any) -> None:
        super().__init__(**options)
        self.config_class = config_class
        groups: dict[str | None, Any] = {None: self}
        for item in flag_fields(config_class):
            flag_options = {"dest": item.dest, "help": item.help.replace("%", "%%"), **item.flag.options}
            if item.kind is bool:
                flag_options["action"] = "store_true"
            else:
                flag_options.setdefault("type", item.kind)
                flag_options["default"] = item.default  # shown by --help; a parse never hands it out (given_flags)
                if item.repeatable and "nargs" not in flag_options:
                    flag_options["action"] = "append"
            if item.title not in groups:
                groups[item.title] = self.add_argument_group(item.title)
            groups[item.title].add_argument(*item.flag.names, **flag_options)

    def error(self, message: str) -> NoReturn:
        """One line, ending ``(see unet-train --help)``: the program as the user started it, the installed command by
        its own name (``unet-train``, from ``sys.argv[0]``), else ``python train.py``; a ``prog`` that is a whole
        command line (``python -m utils.datasets.check``) as it is."""
        command = sys.argv[0].replace("\\", "/").rsplit("/", 1)[-1]
        if not command.startswith("unet-"):
            command = self.prog if self.prog.startswith("python ") else f"python {self.prog}"
        raise ConfigError(f"{message} (see {command} --help)")

    def parse(self, argv: Sequence[str] | None) -> Any:
        """The config from ``argv`` (default: sys.argv[1:]), each value inside its range."""
        return build_config(self.config_class, self.given_flags(argv))

    def given_flags(self, argv: Sequence[str] | None) -> dict[str, Any]:
        """``{dest: value}`` of the flags ``argv`` gives, parsed and each inside its range (a flag not given has no
        key: ``build_config`` gives it its field's default); an unknown flag is a ConfigError naming the closest real
        one."""
        # Every destination starts as None, which no parsed value is, so argparse fills in no default (its defaults
        # are for --help): what is left not None was given.
        unset = argparse.Namespace(**{action.dest: None for action in self._actions})
        namespace, unknown = self.parse_known_args(argv, unset)
        if unknown:
            flags = [option for action in self._actions for option in action.option_strings]
            typo = next((argument.split("=", 1)[0] for argument in unknown if argument.startswith("-")), None)
            self.error(f"unrecognized arguments: {' '.join(unknown)}{did_you_mean(typo, flags) if typo else ''}")
        given = {dest: value for dest, value in vars(namespace).items() if value is not None}
        for item in flag_fields(self.config_class):
            if item.flag.range is not None and item.dest in given:
                for value in given[item.dest] if item.repeatable else [given[item.dest]]:
                    check_range(value, item.flag.name, item.flag.range)
        return given


def check_range(value: Any, flag_name: str, interval: str) -> Any:
    """``value`` when it is finite and inside ``interval`` (``"(0, 1]"``: a parenthesis leaves its bound out, a
    bracket keeps it; ``"[1, inf)"``: no upper bound), else one ConfigError naming the flag, the bounds and the
    value."""
    low_text, high_text = (bound.strip() for bound in interval[1:-1].split(","))
    low, high = float(low_text), float(high_text)
    above_low = value > low if interval[0] == "(" else value >= low
    below_high = value < high if interval[-1] == ")" else value <= high
    if math.isfinite(value) and above_low and below_high:
        return value
    where = f"in {interval}" if math.isfinite(high) else f"{'above' if interval[0] == '(' else 'at least'} {low_text}"
    if isinstance(value, float):
        raise ConfigError(f"{flag_name} must be a finite number {where}, got {value:g}")
    raise ConfigError(f"{flag_name} must be {where}, got {value}")


def build_config(config_class: type, values: Mapping[str, Any]) -> Any:
    """``config_class`` from a flat ``{dest: value}`` (``FlagParser.given_flags``, a checkpoint's ``args``); a missing
    value takes its default, a key that is no flag is left out."""
    hints = typing.get_type_hints(config_class)
    arguments = {}
    for field in dataclasses.fields(config_class):
        if "section" in field.metadata:
            arguments[field.name] = build_config(hints[field.name], values)
        elif "flag" in field.metadata and field.name in values:
            arguments[field.name] = values[field.name]
    return config_class(**arguments)


def did_you_mean(name: str, names: Iterable[str]) -> str:
    """``; did you mean --epochs?``: the one of ``names`` closest to a misspelt ``name``, or "" if none is close."""
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


# ----------------------------------------------------------------------------------------------------
# --class-names and --class-weights: one value per class

CLASS_WEIGHTS_AUTO = "auto"  # --class-weights auto (utils.training.objective computes them)


def split_class_names(text: str) -> tuple[str, ...]:
    """The names in ``text``, separated by commas (as the flag and a run's recorded ``args`` hold them)."""
    return tuple(part.strip() for part in text.split(","))


def per_class(text: str, classes: int, flag_name: str, what: str) -> tuple[str, ...]:
    """``text``'s parts (separated by commas), one per class as ``--classes`` counts them (two for ``--classes 1``),
    else one ConfigError naming ``flag_name`` (``--class-names``, ``--class-weights``) and ``what`` each part is."""
    parts = split_class_names(text)
    expected = 2 if classes == 1 else classes
    if len(parts) != expected:
        order = ", background and foreground" if classes == 1 else ", background first"
        raise ConfigError(
            f"{flag_name} {text} gives {len(parts)} {what}(s) but --classes {classes} needs {expected} (one per "
            f"class{order}, separated by commas)"
        )
    return parts


def parse_class_weights(text: str, classes: int) -> tuple[float, ...] | None:
    """--class-weights as numbers, or None for 'auto' (computed from the training masks); ConfigError if malformed."""
    if text.strip().lower() == CLASS_WEIGHTS_AUTO:
        return None
    try:
        weights = [float(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"--class-weights must be 'auto' or numbers separated by commas, got {text!r}") from None
    per_class(text, classes, "--class-weights", "weight")
    return tuple(check_range(weight, "--class-weights", "(0, inf)") for weight in weights)


def check_class_flags(class_names: str | None, class_weights: str | None, classes: int) -> None:
    """``--class-names`` (one name per class, each its own) and ``--class-weights``, each fitting ``--classes``;
    ConfigError naming the flag if one does not."""
    if class_weights is not None:
        parse_class_weights(class_weights, classes)
    if class_names is None:
        return
    names = per_class(class_names, classes, "--class-names", "name")
    if not all(names):
        raise ConfigError(f"--class-names {class_names!r} has an empty name; give every class a name")
    if len(set(names)) != len(names):
        raise ConfigError(f"--class-names {class_names} names two classes the same; give each class its own name")
