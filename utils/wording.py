"""Counts in messages: ``count(1, "epoch")`` is "1 epoch", ``count(2, "epoch")`` "2 epochs"."""

from __future__ import annotations


def count(number: int, noun: str, plural: str | None = None) -> str:
    """``number`` and ``noun``, the noun in the plural (``plural``, else ``noun + "s"``) unless the number is 1."""
    return f"{number} {noun if number == 1 else plural or noun + 's'}"
