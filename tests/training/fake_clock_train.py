"""``train.py`` with a fake wall clock for the --save-every-minutes tests (run as a script, also under torchrun).

Every reading of ``utils.checkpoint.checkpointer``'s clock is ``FAKE_CLOCK_STEP_S`` seconds after the previous one, so
minutes pass in a few steps while the real saving path runs. The variable is read here only, never by the package.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import train  # noqa: E402
from utils.checkpoint import checkpointer  # noqa: E402

_readings = itertools.count()
_step_s = float(os.environ["FAKE_CLOCK_STEP_S"])
checkpointer.monotonic = lambda: next(_readings) * _step_s

if __name__ == "__main__":
    sys.exit(train.main())
