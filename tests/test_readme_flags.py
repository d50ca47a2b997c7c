"""The flags table of docs/TRAINING.md and train.py's parser list the same flags with the same defaults."""

from __future__ import annotations

import re

from tests.conftest import REPO_ROOT
from utils.flags import FlagField, flag_fields
from utils.training.config import TrainConfig

FLAGS_DOC = REPO_ROOT / "docs" / "TRAINING.md"
DOC_NAME = "docs/TRAINING.md"
TABLE_HEADING = "## Flags"
NO_DEFAULT = "none"  # the table's word for a flag that is unset by default (None, or an empty repeatable flag)
SWITCH_OFF = "off"  # the table's word for a switch (store_true) that is not given


def readme_rows(text: str) -> dict[str, tuple[tuple[str, ...], str]]:
    """``{primary flag: (spellings, default cell)}`` of the table under TABLE_HEADING."""
    section = text.split(f"\n{TABLE_HEADING}\n", 1)[1].split("\n#", 1)[0]
    rows: dict[str, tuple[tuple[str, ...], str]] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) != 3 or not cells[0].startswith("`-"):
            continue
        names = tuple(cells[0].strip("`").split(" ", 1)[0].split("/"))
        assert names[0] not in rows, f"{names[0]} has two rows"
        rows[names[0]] = (names, cells[1].strip("`"))
    return rows


def default_matches(cell: str, item: FlagField) -> bool:
    default = item.default
    if item.kind is bool:
        return cell == SWITCH_OFF and default is False
    if default is None or default == []:
        return cell == NO_DEFAULT
    if item.kind in (int, float):
        try:
            return item.kind(cell) == default
        except ValueError:
            return False
    return cell == default


def disagreements(text: str) -> list[str]:
    """What the flags table and TrainConfig's flags say differently, one line each."""
    rows = readme_rows(text)
    problems = []
    flags = {item.flag.name: item for item in flag_fields(TrainConfig)}
    for name, item in flags.items():
        if name not in rows:
            problems.append(f"{name} is missing from {DOC_NAME}'s flags table")
            continue
        names, cell = rows[name]
        if not set(names) <= set(item.flag.names):
            problems.append(f"{DOC_NAME} spells {name} as {'/'.join(names)}, the parser as {item.flag.names}")
        if not default_matches(cell, item):
            problems.append(f"{DOC_NAME} gives {name} the default {cell!r}, the parser {item.default!r}")
    problems.extend(f"{DOC_NAME} lists {name}, which train.py does not have" for name in rows.keys() - flags.keys())
    return problems


def test_the_flags_table_matches_the_train_parser() -> None:
    problems = disagreements(FLAGS_DOC.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


def test_a_missing_row_an_unknown_flag_and_a_wrong_default_are_each_found() -> None:
    text = FLAGS_DOC.read_text(encoding="utf-8")
    assert "| `--epochs/-e N` | `5` |" in text and "| `--compile` | off |" in text
    doctored = (
        text.replace("| `--epochs/-e N` | `5` |", "| `--epochs/-e N` | `6` |")
        .replace("| `--compile` | off |", "| `--compyle` | off |")
        .replace("| `--amp` | off |", "| `--amp/-a` | off |")
    )
    assert sorted(disagreements(doctored)) == [
        "--compile is missing from docs/TRAINING.md's flags table",
        "docs/TRAINING.md gives --epochs the default '6', the parser 5",
        "docs/TRAINING.md lists --compyle, which train.py does not have",
        "docs/TRAINING.md spells --amp as --amp/-a, the parser as ('--amp',)",
    ]
