"""What the entry scripts share: logging set-up, flag value types, and turning a user error into one line.

Log lines go to stdout so that stderr carries progress bars and, on failure, the one ``Error: ...`` line.
"""

from __future__ import annotations

import logging
import sys

from utils.errors import ConfigError, user_message


def setup_logging(rank: int, world_size: int) -> None:
    """INFO on rank 0, WARNING elsewhere; rank-prefixed lines when there are several processes."""
    prefix = f"[rank {rank}] " if world_size > 1 else ""
    root = logging.getLogger()
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if not any(getattr(handler, "_unet_handler", False) for handler in root.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler._unet_handler = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    for handler in root.handlers:
        if getattr(handler, "_unet_handler", False):
            # main() may run several times in one process (tests), each time with its own sys.stdout.
            # Assign rather than setStream(): that flushes the previous stream, which pytest may have closed already.
            handler.stream = sys.stdout
            handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(message)s", "%H:%M:%S"))


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
