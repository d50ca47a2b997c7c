"""The launcher watch stops an orphaned worker, once its launcher is gone, and says why, once.

Real processes: a parent starts a worker and is killed with SIGKILL; the worker's watcher thread notices that its
parent PID changed and sends the worker SIGTERM, which the worker records instead of dying of it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO_ROOT, child_env

_WORKER = """
import logging, signal, sys, time
from pathlib import Path
from utils.launch.signals import stop_when_orphaned
logging.basicConfig(level=logging.WARNING, format="%(message)s")
received = []
signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
stop_when_orphaned(poll_interval_s=0.05)
time.sleep(0.5)  # ten checks of a parent that lives: nothing happens
Path(sys.argv[1]).write_text(f"ready {received}")
deadline = time.monotonic() + 60
while not received and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(0.5)  # the watch is over: no second signal, no second line
print("stopped by", received)
"""

# The launcher stand-in: starts the worker (its output to files) and waits.
_PARENT = """
import subprocess, sys
with open(sys.argv[2], "w") as out, open(sys.argv[3], "w") as err:
    subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[4]], stdout=out, stderr=err).wait()
"""


def test_a_worker_whose_launcher_is_killed_stops_and_says_why_once(tmp_path: Path) -> None:
    ready, out, err = tmp_path / "ready", tmp_path / "out", tmp_path / "err"
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, _WORKER, str(out), str(err), str(ready)], cwd=REPO_ROOT, env=child_env()
    )
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists(), err.read_text() if err.exists() else "no worker output"
    assert ready.read_text() == "ready []" and err.read_text() == "", "the launcher lives: nothing to stop or say"
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 60
    while "stopped by" not in out.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert out.read_text().strip() == f"stopped by [{int(signal.SIGTERM)}]"
    lines = err.read_text().splitlines()
    assert lines == [f"The launcher (PID {parent.pid}) is gone; stopping this worker as for SIGTERM"], lines
