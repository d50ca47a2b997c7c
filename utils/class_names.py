"""Class names (``train.py --class-names background,car``): checked once, recorded in checkpoints for the legends.

A name per class, background first, as ``--class-weights`` counts them (two for ``--classes 1``). Predict's overlay
legends and evaluate's table show them beside the mask values; a checkpoint without names shows the values alone.
"""

from __future__ import annotations

from utils.errors import ConfigError

CLASS_NAMES_FLAG = "--class-names"


def split_class_names(text: str) -> tuple[str, ...]:
    """The names in ``text``, separated by commas (as the flag and a run's recorded ``args`` hold them)."""
    return tuple(part.strip() for part in text.split(","))


def parse_class_names(text: str, classes: int) -> tuple[str, ...]:
    """``text`` (names separated by commas) as one name per class; ConfigError naming the flag if it does not fit."""
    names = split_class_names(text)
    expected = 2 if classes == 1 else classes
    if len(names) != expected:
        background = ", background and foreground" if classes == 1 else ", background first"
        raise ConfigError(
            f"{CLASS_NAMES_FLAG} {text} gives {len(names)} name(s) but --classes {classes} needs {expected} (one per "
            f"class{background}, separated by commas)"
        )
    if not all(names):
        raise ConfigError(f"{CLASS_NAMES_FLAG} {text!r} has an empty name; give every class a name")
    if len(set(names)) != len(names):
        raise ConfigError(f"{CLASS_NAMES_FLAG} {text} names two classes the same; give each class its own name")
    return names
