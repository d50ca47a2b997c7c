"""Ctrl-C while an entry script is still starting (importing torch takes seconds): one line and exit 130.

Imported first by the entry scripts, before anything heavy, so it imports nothing but the standard library. Until the
script installs its own handling (``utils.training.interrupts`` in train.py; predict.py and evaluate.py call
``startup_done`` so that Ctrl-C raises KeyboardInterrupt again, which ``utils.runner`` reports), a SIGINT would
otherwise interrupt an import and print a long traceback through torch's modules.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

STARTUP_EXIT_CODE = 128 + signal.SIGINT  # the shell's convention for death by SIGINT, as utils.runner's


def _stop_during_startup(signum: int, frame: FrameType | None) -> None:
    # Nothing has been created yet: leave at once (os._exit: no half-imported module's clean-up runs).
    sys.stderr.write("Error: stopped by SIGINT (Ctrl-C) while starting; nothing was written\n")
    sys.stderr.flush()
    os._exit(STARTUP_EXIT_CODE)


def stop_quietly_while_starting() -> None:
    """SIGINT exits with one line and status 130 until the script installs its own handler."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when a parent chose to ignore it
        signal.signal(signal.SIGINT, _stop_during_startup)


def startup_done() -> None:
    """Give SIGINT back to Python (KeyboardInterrupt) once the imports are over: from then on the script may have
    written something, and its own handling says what. Leaves any other handler alone (a test, a parent's choice)."""
    if signal.getsignal(signal.SIGINT) is _stop_during_startup:
        signal.signal(signal.SIGINT, signal.default_int_handler)
