"""The one way out of ``train.py``, ``predict.py`` and ``evaluate.py``: each error becomes an exit status and one line.

| what stopped the run | exit status | stderr |
| --- | --- | --- |
| finished | 0 | nothing |
| a user error (``UserError``: a flag, a file, the data) | 2 | one ``Error:`` line naming the flag or file and the fix |
| out of memory (CUDA, or the CPU allocator) | 2 | one ``Error:`` line naming the flags that lower memory use |
| another rank of the job died or stopped answering | 1 | one ``Error:`` line saying where to look and how to resume |
| SIGINT / SIGTERM | 130 / 143 | (``train.py`` saves and logs how to resume itself) |
| a bug | 1 | Python's traceback |

Out of memory counts as a user error: a smaller ``--batch-size`` (or the script's other memory flags) fixes it.
Under a distributed launch a user error every rank has is printed once, by global rank 0 (``RunStage``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import torch

from utils.cli import print_error, setup_logging
from utils.errors import USER_ERROR_EXIT_CODE, UserError, first_line
from utils.launch.environments import LaunchValueError
from utils.launch.process_group import DistributedContext, barrier
from utils.launch.signals import signal_exit_code, startup_done, stopped_during_startup

LOST_CONTACT_EXIT_CODE = 1

# How the CPU allocator words an allocation failure (a RuntimeError; numpy's is a MemoryError, CUDA's its own type).
ALLOCATOR_MARKERS = ("can't allocate memory", "DefaultCPUAllocator")

# How gloo words it when another process died (closed connection) or stopped answering (--dist-timeout); NCCL and
# the rendezvous store raise torch.distributed.DistError instead. Compared in lower case.
PEER_FAILURE_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out waiting",
    "timeout caused pair closure",
    "socket timeout",
)

# How long a rank other than 0 waits before exiting after an error that rank 0 prints. torchrun stops the other
# workers as soon as one exits, so rank 0 must exit first: it has then printed the message, and it is the failure
# torchrun reports. After an agreed error a barrier guarantees the printing, and a few seconds let rank 0 leave first:
# on a loaded machine rank 0's teardown and exit took over a second, and a rank leaving before it made gloo abort rank
# 0 (SIGABRT, reported by torchrun as the root cause instead of the user error). Under torchrun the others are stopped
# as soon as rank 0 has exited, so the wait is only an upper bound.
# A bad flag is found before the processes meet, and rank 0 may still be importing torch: the others wait until
# torchrun stops them (it does as soon as rank 0 has exited), or this long at most.
QUIET_EXIT_DELAY_S = 5.0
QUIET_EXIT_BEFORE_JOINING_S = 60.0


@dataclass
class RunStage:
    """How far a run got, which decides who prints a user error: the launcher's rank until the process group exists
    (``ctx``); ``joining`` while this process meets the others (an error there is its own)."""

    rank: int = 0
    ctx: DistributedContext | None = None
    joining: bool = False


def run_main(body: Callable[[], int], *, oom_fix: str, stage: RunStage | None = None) -> int:
    """Run ``body`` (an entry script's work, returning its exit status) and turn what it raises into the status and
    the one line of the table above. ``oom_fix`` names the flags that lower this script's memory use."""
    stage = stage if stage is not None else RunStage()
    try:
        return body()
    except UserError as error:
        report_user_error(error, stage)
        return USER_ERROR_EXIT_CODE
    except KeyboardInterrupt:  # a script that installs no handler of its own (train.py does)
        print_error("stopped by SIGINT (Ctrl-C)")
        return signal_exit_code(signal.SIGINT)
    except (MemoryError, RuntimeError) as error:  # CUDA's OutOfMemoryError and DistError are RuntimeErrors
        text = str(error)
        cuda = isinstance(error, torch.cuda.OutOfMemoryError)
        if cuda or isinstance(error, MemoryError) or any(marker in text for marker in ALLOCATOR_MARKERS):
            print_error(f"{'CUDA' if cuda else 'the CPU'} ran out of memory; {oom_fix}")
            return USER_ERROR_EXIT_CODE
        lost = isinstance(error, torch.distributed.DistError)  # NCCL's and the store's; gloo's are worded
        if lost or any(marker in text.lower() for marker in PEER_FAILURE_MARKERS):
            print_error(
                f"lost contact with another training process ({first_line(error)}); see the other processes' logs, "
                "then continue with --resume auto (under torchrun, --max-restarts does that by itself)"
            )
            return LOST_CONTACT_EXIT_CODE
        raise
    except SystemExit as exit_request:  # --help, or argparse's own usage error (status 2)
        return exit_request.code if isinstance(exit_request.code, int) else 0


def run_single_process(body: Callable[[], int], *, oom_fix: str) -> int:
    """``main`` of predict.py and evaluate.py: ``run_main`` in one process, which logs as rank 0, once the imports are
    over (``startup_done``: Ctrl-C is a KeyboardInterrupt again, which ``run_main`` reports)."""
    startup_done()
    setup_logging(rank=0, world_size=1)
    return run_main(body, oom_fix=oom_fix)


def leave(status: int) -> NoReturn:
    """End ``train.py`` with ``status`` once its ``main`` returned, without Python's finalisation: the run's files are
    closed, the run folder unlocked and the process group torn down by then, and the interpreter's own teardown (module
    clean-up with torch loaded) takes seconds of CPU on a loaded machine that would only hold up the end of a job."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing left to tell
            stream.flush()
    os._exit(status)


def report_user_error(error: UserError, stage: RunStage) -> None:
    """Print ``error`` once per job: a bad flag (found before joining) and an error the ranks agreed on reach every
    rank, and rank 0 alone prints it; a failure to join, or one found by one rank alone (a corrupt image), is printed
    where it happened, as is a launch value of this process's own (``LaunchValueError``: its rank, say). With a shared
    error the other ranks leave after rank 0."""
    ctx = stage.ctx
    own = isinstance(error, LaunchValueError)
    shared = (ctx is None and not stage.joining and not own) or getattr(error, "on_every_rank", False)
    quiet = shared and stage.rank != 0
    if not quiet:
        print_error(error)
    if shared and ctx is not None and ctx.is_distributed:
        try:
            barrier(ctx)  # rank 0 has printed
        except (RuntimeError, torch.distributed.DistError):
            pass  # a rank is gone already: nothing left to wait for
    if quiet:
        # torchrun stops the others with SIGTERM once rank 0 has exited; the stop handler installed at the start would
        # take it as a request to save and sleep on, until torchrun's SIGKILL 30 s later.
        # Its SIGTERM may have come already, while the start-up handler only remembered it: then leave at once.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if not stopped_during_startup():
            time.sleep(QUIET_EXIT_DELAY_S if ctx is not None else QUIET_EXIT_BEFORE_JOINING_S)
