"""What the entry scripts share: logging set-up, flag value types, and turning a user error into one line.

Log lines go to stdout so that stderr carries progress bars and, on failure, the one ``Error: ...`` line.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import warnings
from typing import TextIO

from utils.errors import ConfigError, user_message

DEVICES = ("auto", "cuda", "mps", "cpu")  # --device's words besides cuda:N (this module imports no torch)


# The one handler of the scripts' log lines, on the root logger.
_HANDLER = logging.StreamHandler()


def setup_logging(rank: int, world_size: int) -> None:
    """INFO on rank 0; rank-prefixed lines when there are several processes.

    Ranks other than 0 log errors only: every warning they could print (the data, the flags, the checkpoint, this
    CPU) rank 0 prints too, and N copies bury it. Python's warnings are silenced there for the same reason.
    """
    prefix = f"[rank {rank}] " if world_size > 1 else ""
    root = logging.getLogger()
    root.setLevel(logging.INFO if rank == 0 else logging.ERROR)
    if rank != 0:
        warnings.simplefilter("ignore")
    # main() may run several times in one process (tests), each time with its own sys.stdout. Assigned rather than
    # setStream(): that flushes the previous stream, which pytest may have closed already.
    _HANDLER.stream = sys.stdout
    _HANDLER.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(message)s", "%H:%M:%S"))
    if _HANDLER not in root.handlers:
        root.addHandler(_HANDLER)


def print_error(message: object) -> None:
    """The one line a person reads when a run stops for something they can fix.

    An exception re-raised from a DataLoader worker gives its own message, not the worker's traceback.
    """
    text = user_message(message) if isinstance(message, BaseException) else " ".join(str(message).split())
    print(f"Error: {text}", file=sys.stderr)


def parse_size(text: str, flag: str) -> tuple[int, int]:
    """``"480x320"`` to ``(480, 320)``: width first, as Carvana's 1918x1280 and PIL's ``Image.size``."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(part.strip().isdigit() and int(part) > 0 for part in parts):
        raise ConfigError(f"{flag} must look like WIDTHxHEIGHT with positive numbers (e.g. 480x320), got {text!r}")
    return int(parts[0]), int(parts[1])


def device_flag(text: str) -> str:
    """``--device``'s value type in train.py, predict.py and evaluate.py, so that it is spelled the same in all three;
    ``utils.hardware.pick_device`` turns it into the device."""
    if text in DEVICES or re.fullmatch(r"(cuda|cpu|mps):\d+", text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a device; use {', '.join(DEVICES)} or cuda:N")


def stderr_is_terminal(stream: TextIO | None = None) -> bool:
    """Whether progress bars can redraw in place: on a terminal. In a file (a cluster job's log, a pipe) their carriage
    returns leave thousands of fragments, so the scripts log lines instead."""
    stream = sys.stderr if stream is None else stream
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False
