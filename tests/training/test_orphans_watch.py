"""The launcher watch says once why an orphaned worker stopped, also when the kernel's parent-death signal came first.

Real processes: a parent starts a worker and is killed with SIGKILL; the worker's watcher thread polls only once an
hour here, so only the kernel's signal (``PR_SET_PDEATHSIG``) can stop it, as when a worker saves and exits within
the watcher's poll interval.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, child_env
from utils.launch.signals import LauncherWatch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

_WORKER = """
import logging, signal, sys, time
from pathlib import Path
from utils.launch.signals import stop_when_orphaned
logging.basicConfig(level=logging.WARNING, format="%(message)s")
received = []
signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
watch = stop_when_orphaned(poll_interval_s=3600)
Path(sys.argv[1]).write_text("ready")
deadline = time.monotonic() + 60
while not received and time.monotonic() < deadline:
    time.sleep(0.05)
if received:
    watch.report_if_gone(received[0])
    watch.report_if_gone(received[0])  # said once only
print("stopped by", received)
"""

# The launcher stand-in: starts the worker (its output to files) and waits.
_PARENT = """
import subprocess, sys
with open(sys.argv[2], "w") as out, open(sys.argv[3], "w") as err:
    subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[4]], stdout=out, stderr=err).wait()
"""


def test_a_worker_stopped_by_the_kernels_signal_says_its_launcher_is_gone(tmp_path: Path) -> None:
    ready, out, err = tmp_path / "ready", tmp_path / "out", tmp_path / "err"
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, _WORKER, str(out), str(err), str(ready)], cwd=REPO_ROOT, env=child_env()
    )
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists(), err.read_text() if err.exists() else "no worker output"
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 60
    while "stopped by" not in out.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert out.read_text().strip() == f"stopped by [{int(signal.SIGTERM)}]"
    lines = err.read_text().splitlines()
    assert lines == [f"The launcher (PID {parent.pid}) is gone; stopping this worker as for SIGTERM"], lines


def test_a_worker_whose_launcher_lives_reports_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        LauncherWatch(os.getppid()).report_if_gone()
    assert not caplog.records
