"""Whether a pickle would run code: the classes and functions it imports, read from its opcodes, never unpickled.

``torch.load(weights_only=True)`` refuses such files, but its message advises loading them with
``weights_only=False``, which is exactly what must not be done with a file of unknown origin. Loaders catch its
refusal and ask ``pickled_code`` which names the file would import, to say "contains code (pickled objects),
refused" instead. Names torch's safe loader allows (its tensor rebuild functions, ``collections.OrderedDict``, ...)
are data, not code.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import re
import zipfile
from pathlib import Path

# Opcodes that push a string a later STACK_GLOBAL may take as a module or a name.
_STRING_OPCODES = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "SHORT_BINSTRING"})
_MEMO_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})


def pickled_code(path: str | Path) -> list[str]:
    """The ``module.name`` globals a pickle file (or a torch.save archive's ``data.pkl``) would import that torch's
    safe loader does not allow; empty for a file of plain data or one that is not a pickle at all."""
    allowed = _allowed_globals()
    return [name for name in dict.fromkeys(_imported_globals(_pickle_bytes(Path(path)))) if name not in allowed]


def code_refusal(names: list[str]) -> str:
    """The words for a file that imports ``names`` when unpickled (``names`` may be empty when torch named none)."""
    listed = f": {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}" if names else ""
    return (
        f"it contains code (pickled objects{listed}), refused: unpickling them could run code, so only tensors, "
        "numbers, strings and containers are accepted"
    )


def without_unsafe_advice(error: BaseException) -> str:
    """torch's refusal without its advice to load the file unsafely: the operand it stopped at, in one line."""
    text = str(error)
    found = re.search(r"WeightsUnpickler error:(.*?)(?:Check the documentation|$)", text, re.DOTALL)
    if found and found.group(1).strip():
        return " ".join(found.group(1).split())
    if "weights_only" in text:  # torch's advice with no operand named: say no more than torch's first sentence
        return "torch's safe loader cannot read it"
    return " ".join(text.split())[:200]


def _pickle_bytes(path: Path) -> bytes:
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                member = next((name for name in archive.namelist() if name.endswith("data.pkl")), None)
                return archive.read(member) if member is not None else b""
        return path.read_bytes()
    except (OSError, zipfile.BadZipFile, ValueError):
        return b""


def _imported_globals(data: bytes) -> list[str]:
    """The globals named by GLOBAL, INST and STACK_GLOBAL opcodes, up to the first unreadable opcode."""
    names: list[str] = []
    recent: list[object] = []  # what each opcode pushed, as far as STACK_GLOBAL needs to know (strings)
    memo: dict[object, object] = {}
    try:
        for opcode, argument, _ in pickletools.genops(io.BytesIO(data)):
            if opcode.name in ("GLOBAL", "INST"):
                names.append(".".join(str(argument).split(" ", 1)))
            elif opcode.name == "STACK_GLOBAL":
                module, name = (recent[-2:] if len(recent) >= 2 else [None, None])[:2]
                known = isinstance(module, str) and isinstance(name, str)
                names.append(f"{module}.{name}" if known else "an unnamed global")
            elif opcode.name in _STRING_OPCODES:
                recent.append(argument)
                continue
            elif opcode.name == "MEMOIZE":
                memo[len(memo)] = recent[-1] if recent else None
                continue
            elif opcode.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[argument] = recent[-1] if recent else None
                continue
            elif opcode.name in _MEMO_GETS:
                recent.append(memo.get(argument))
                continue
            recent.append(None)
    except (ValueError, EOFError, pickle.UnpicklingError, UnicodeDecodeError):
        pass  # the rest is not a pickle (a torch legacy file's raw storage bytes follow its pickles)
    return names


def _allowed_globals() -> set[str]:
    """What ``torch.load(weights_only=True)`` accepts: torch's own list (private, so with a fallback) and the
    globals a user allowed with ``torch.serialization.add_safe_globals``."""
    import torch

    allowed = {"collections.OrderedDict", "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_parameter"}
    try:
        from torch._weights_only_unpickler import _get_allowed_globals

        allowed.update(_get_allowed_globals())
    except (ImportError, AttributeError):
        pass
    for entry in torch.serialization.get_safe_globals():
        item = entry[0] if isinstance(entry, tuple) else entry
        allowed.add(f"{getattr(item, '__module__', '')}.{getattr(item, '__qualname__', '')}")
    return allowed
