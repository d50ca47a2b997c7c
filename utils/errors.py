"""User-facing error types.

Every problem a user can fix (a bad flag, a missing file, an odd mask, a broken checkpoint) is raised as a
``UserError`` whose message names the flag or file and says what to do. Entry scripts catch ``UserError`` and turn it
into one line on stderr and a non-zero exit; anything else is a bug and keeps its traceback.

Counts in messages go through ``count``: ``count(1, "epoch")`` is "1 epoch", ``count(2, "epoch")`` "2 epochs".
"""

from __future__ import annotations

import re


class UserError(Exception):
    """A problem the user can fix; the message names the file or flag and the fix.

    Raised in a DataLoader worker, it comes back to the main process as the same class carrying the worker's
    traceback; ``str()`` still gives the one-line message, so every entry point prints the same ``Error:`` line.
    """

    def __str__(self) -> str:
        return _worker_message(type(self).__name__, super().__str__())


class ConfigError(UserError):
    """A flag or flag combination is invalid."""


class DatasetError(UserError):
    """The image or mask folders cannot be used as they are."""


class CheckpointError(UserError):
    """A checkpoint file is missing, corrupt, unsafe or does not fit the model."""


# Exit status used by entry scripts for user errors (argparse uses 2 for bad flags too).
USER_ERROR_EXIT_CODE = 2


# PyTorch re-raises an exception from a DataLoader worker as the same class with this text before the worker's
# traceback; the message a user should read is the last line of that traceback.
_WORKER_PREFIX = re.compile(r"^Caught \w+ in DataLoader worker process \d+\.")


def _worker_message(class_name: str, text: str) -> str:
    """``text`` without the worker's traceback when PyTorch wrapped it, else unchanged."""
    if not _WORKER_PREFIX.match(text):
        return text
    # The traceback ends with "module.ClassName: message" (the message itself may span lines).
    found = list(re.finditer(rf"^(?:[\w.]+\.)?{re.escape(class_name)}: ", text, re.MULTILINE))
    return " ".join(text[found[-1].end() :].split()) if found else text


def user_message(error: BaseException) -> str:
    """The one-line message of ``error``; for one re-raised from a loader worker, the worker's own message."""
    return " ".join(_worker_message(type(error).__name__, str(error)).split())


def first_line(error: BaseException) -> str:
    """The first line of an exception's message: some libraries (PyTorch's communication among them) write
    paragraphs."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def shortened(value: object, limit: int = 80) -> str:
    """``repr(value)`` for a message, at most ``limit`` characters: a file's value can be large."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ----------------------------------------------------------------------------------------------------
# counts in messages


def count(number: int, noun: str, plural: str | None = None) -> str:
    """``number`` and ``noun``, the noun in the plural (``plural``, else ``noun + "s"``) unless the number is 1."""
    return f"{number} {noun if number == 1 else plural or noun + 's'}"


def refused_code(error: BaseException) -> str | None:
    """Why ``torch.load(weights_only=True)`` refused a file whose pickle imports code (the global torch's ``error``
    names), without torch's advice to load it with ``weights_only=False``; None when ``error`` is about anything else.

    The one wording of such a refusal: checkpoints (``utils.checkpoint.files``), dataset tensor files
    (``utils.datasets.image_files``).
    """
    imported = re.search(r"GLOBAL (\S+)", str(error))
    if imported is None:
        return None
    return (
        f"it contains code (pickled objects: {imported.group(1)}), refused: unpickling them could run code, so only "
        "tensors, numbers, strings and containers are accepted"
    )
