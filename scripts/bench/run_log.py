"""What a measured ``train.py`` run says it did: its "Starting training" log line, read back.

The benchmark labels each figure with the precision, threads and loader workers it asked for; these readers check
the run really used them (a flag default or an ``--amp`` resolution could choose otherwise).
"""

from __future__ import annotations

import re
from typing import Any

from scripts.bench.processes import MeasurementError

_SUMMARY = re.compile(
    r"(?P<train>\d+) training / (?P<val>\d+) validation images, .*?"
    r"precision (?P<precision>\w+), device (?P<device>\S+), (?P<threads>\d+) CPU threads?\b.*?"
    r"(?P<workers>\d+) loader workers?\b"
)


def run_summary(log_text: str) -> dict[str, Any]:
    """The precision, device, CPU threads and loader workers a ``train.py`` run logged in its "Starting training"
    line: what the run really did, whatever flags it was given."""
    match = _SUMMARY.search(log_text)
    if match is None:
        raise MeasurementError("the train.py log has no 'Starting training: ... precision ...' line to check")
    return {
        "precision": match["precision"],
        "device": match["device"],
        "threads": int(match["threads"]),
        "loader_workers": int(match["workers"]),
        "train_images": int(match["train"]),
        "val_images": int(match["val"]),
    }


def check_precision(log_text: str, expected: str, name: str) -> dict[str, Any]:
    """``run_summary``, refusing a run that trained in another precision than the figure it gives is labelled with."""
    summary = run_summary(log_text)
    if summary["precision"] != expected:
        raise MeasurementError(f"{name}: the row is {expected} but train.py trained in {summary['precision']}")
    return summary
