"""The last line of a prediction run: what was written, how many, and where, so a person knows where to look."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from utils.wording import count

# Folders named in full; a run writing beside inputs in more folders names these and counts the rest.
MAX_FOLDERS_NAMED = 3


def prediction_summary(written: int, total: int, *, masks: bool, viz: bool, folders: Sequence[Path]) -> str:
    """``"Wrote 8 masks and 8 overlays (8 of 8 images) to outputs/demo"``; ``folders``: where the outputs go."""
    kinds = [count(written, noun) for noun, wanted in (("mask", masks), ("overlay", viz)) if wanted]
    names = sorted({str(folder) for folder in folders})
    where = ", ".join(names[:MAX_FOLDERS_NAMED])
    if len(names) > MAX_FOLDERS_NAMED:
        where += f" and {count(len(names) - MAX_FOLDERS_NAMED, 'other folder')}"
    what = " and ".join(kinds) if kinds else "nothing (--no-save without --viz)"
    return f"Wrote {what} ({written} of {count(total, 'image')}) to {where}"
