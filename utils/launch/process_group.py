"""The process group: joining it (the side effects of a ``LaunchPlan``), the small collectives the training loop
uses, the agreements that keep one rank's error or signal from hanging the others, ``--sync-bn``, and the way out of
``train.py``, ``predict.py`` and ``evaluate.py`` (``run_main``: each error an exit status and one line, printed once
per job).

The control messages (barriers, broadcasts, the agreements) run on a second, gloo, CPU group, so that they never wait
behind gradient traffic or force a GPU synchronisation; the sums of metrics and ``CpuSyncBatchNorm``'s statistics use
the default group, on the training device.

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
import datetime
import gc
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.nn.functional import all_reduce as all_reduce_with_grad

from utils import errors
from utils.cli import print_error, setup_logging
from utils.errors import USER_ERROR_EXIT_CODE, ConfigError, UserError, first_line
from utils.hardware import available_cpus, pick_device, threads_per_process
from utils.launch.environments import LaunchPlan, LaunchValueError
from utils.launch.signals import InterruptFlag, signal_exit_code, startup_done, stopped_during_startup

if TYPE_CHECKING:
    from utils.training.config import LaunchSection, PerformanceSection

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


@dataclass(frozen=True, kw_only=True)
class DistributedContext(LaunchPlan):
    """This process's place in the job: its launch plan, and the device and groups that joining made.

    ``is_main`` (global rank 0) is the only writer of files and logs.
    """

    device: torch.device
    control_group: Any = None
    """The gloo group of the control messages (see the module docstring)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """Joined a process group (the plan was distributed)."""
        return self.distributed


def setup(plan: LaunchPlan, performance: PerformanceSection, launch: LaunchSection) -> DistributedContext:
    """Pick the device (--device), size the CPU thread pool (--threads), and join the process group when the plan is
    distributed (within --dist-timeout); the flags' sections are handed whole."""
    device = pick_device(performance.device, local_rank=plan.local_rank, distributed=plan.distributed)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(performance.threads or threads_per_process(available_cpus(), plan.local_world_size))
    if plan.warning:
        logger.warning(plan.warning)
    if not plan.distributed:
        return DistributedContext(**vars(plan), device=device)

    check_rendezvous_host(plan)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=launch.dist_timeout)
    join = {"backend": backend, "rank": plan.rank, "world_size": plan.world_size, "timeout": timeout}
    try:
        with _native_output_to_debug():
            if plan.store_namespace is not None and plan.master_address is not None:
                host, port = plan.master_address.rsplit(":", 1)
                # torchrun's agent serves this store; a client of it, with keys of this attempt only.
                agent_store = dist.TCPStore(host, int(port), plan.world_size, is_master=False, timeout=timeout)
                join["store"] = dist.PrefixStore(plan.store_namespace, agent_store)
            dist.init_process_group(init_method=None if "store" in join else plan.init_method, **join)
    except dist.DistError as error:
        raise ConfigError(
            f"rank {plan.rank} could not join the other {plan.world_size - 1} process(es) at "
            f"{plan.master_address or plan.init_method} within "
            f"--dist-timeout {launch.dist_timeout:g} s ({first_line(error)}); check that {plan.address_hint} names "
            "rank 0's machine and a free, reachable port, and start every rank within --dist-timeout"
        ) from error
    # The timeout must be given again: a new group does not inherit it and would wait 30 minutes for a dead rank.
    control_group = dist.new_group(backend="gloo", timeout=timeout)
    return DistributedContext(**vars(plan), device=device, control_group=control_group)


@contextlib.contextmanager
def _native_output_to_debug() -> Iterator[None]:
    """While the ranks meet, what PyTorch's C++ side prints on stderr (each retry, then the failure with some 40 lines
    of C++ stack frames) goes to the debug log instead: the user gets the one line of ``setup``'s ConfigError. The
    level is read once when torch loads (``TORCH_CPP_LOG_LEVEL``), too early to be changed for this step alone."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode(errors="replace").strip()
            if text:
                logger.debug("PyTorch's output while joining the process group:\n%s", text)


def check_rendezvous_host(plan: LaunchPlan) -> None:
    """Refuse a rendezvous host that does not resolve, in one line, before the process group waits its timeout (none
    to check where the init method names no address: a file store, say)."""
    if plan.master_address is None:
        return
    host, _, port = plan.master_address.rpartition(":")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as error:
        reason = error.strerror if isinstance(error, socket.gaierror) else str(error)
        raise LaunchValueError(
            f"the rendezvous host {host.strip('[]')!r} (from {plan.address_hint}) cannot be resolved ({reason}); give "
            "rank 0's machine name or address"
        ) from error


def teardown(ctx: DistributedContext) -> None:
    if ctx.is_distributed and dist.is_initialized():
        # What still holds a group (DDP's reducer in a reference cycle) goes first, while the group lives: freed later,
        # at the interpreter's exit, it aborted a rank now and then ("terminate called without an active exception").
        gc.collect()
        dist.destroy_process_group()


def barrier(ctx: DistributedContext) -> None:
    """Wait for every rank (on the CPU control group, so no GPU stream is involved)."""
    if ctx.is_distributed:
        dist.barrier(group=ctx.control_group)


def sum_across_ranks(ctx: DistributedContext, values: Tensor) -> Tensor:
    """Element-wise sum over ranks of a small tensor (on the training device, at log steps only)."""
    if ctx.is_distributed:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def decide_on_main(ctx: DistributedContext, decide: Callable[[], _T]) -> _T:
    """Run ``decide`` on global rank 0 only and return its result (a small picklable object: paths, scores) on every
    rank; its UserError is raised everywhere."""
    decision = agree_on_errors(ctx, lambda: decide() if ctx.is_main else None)
    if ctx.is_distributed:
        box = [decision]
        dist.broadcast_object_list(box, src=0, group=ctx.control_group)
        decision = box[0]
    return decision


def agree_on_errors(ctx: DistributedContext, build: Callable[[], _T]) -> _T:
    """Run ``build`` on every rank; if it raises a UserError on any rank, raise the lowest such rank's on all."""
    if not ctx.is_distributed:
        return build()
    result, failure = None, None
    try:
        result = build()
    except UserError as error:
        failure = error
    # One integer all-reduce decides; the messages travel (pickled, dearer) only when some rank failed, so this is
    # cheap enough to guard every batch the training loop fetches.
    failed = torch.tensor([failure is not None], dtype=torch.int32)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=ctx.control_group)
    if not failed.item():
        return result
    reports: list[Any] = [None] * ctx.world_size
    mine = None if failure is None else (type(failure).__name__, str(failure))
    dist.all_gather_object(reports, mine, group=ctx.control_group)
    rank, (type_name, message) = next((rank, report) for rank, report in enumerate(reports) if report is not None)
    if rank == ctx.rank:
        raise raised_on_every_rank(failure)
    # The same type where utils.errors has it (their constructors take the message alone), else a UserError.
    error_type = getattr(errors, type_name, UserError)
    raise raised_on_every_rank(error_type(f"rank {rank}: {message}"))


def raised_on_every_rank(error: UserError) -> UserError:
    """Mark ``error`` as raised with the same message on every rank, so that only global rank 0 needs to print it."""
    error.on_every_rank = True  # type: ignore[attr-defined]
    return error


class StopAgreement:
    """Makes every rank see the same stop decision at the same step boundary, without blocking the step.

    torchrun forwards SIGINT/SIGTERM to its workers, a terminal's Ctrl-C reaches every process of the job, and a
    cluster scheduler may signal only some ranks. So at every optimizer-step boundary the ranks agree on
    ``max(signal)`` (``InterruptFlag``, which only records it) with a one-integer all-reduce on the control group. The
    all-reduce is started asynchronously and read one step later: the training loop never waits for it, and every rank
    still sees the same answer at the same step, so all of them stop together, rank 0 writes ``INTERRUPTED.pth`` and
    each process exits with ``128 + signal``. Only the first boundary waits for its own answer: a signal that came
    during start-up or set-up (SLURM's ``--signal`` can) stops the run at its first step, as with one process.

    The same all-reduce carries rank 0's wish to save by wall time (--save-every-minutes): only rank 0 reads its
    clock, and every rank learns its decision at the same step boundary, so all of them save at the same step.
    """

    def __init__(self, ctx: DistributedContext, flag: InterruptFlag) -> None:
        self._ctx = ctx
        self._flag = flag
        self._pending: tuple[Any, Tensor] | None = None
        self._first = True
        self.save_agreed = False
        """Set by ``poll``: whether a rank asked to save (``save_due``) at the boundary whose answer arrived."""

    def poll(self, *, save_due: bool = False) -> int:
        """The signal all ranks agree to stop for (0 = keep going); call once per step boundary on every rank.

        ``save_due``: this rank asks every rank to save; ``save_agreed`` tells whether any rank asked (with several
        processes the answer arrives at the next boundary, the same one on every rank).
        """
        if not self._ctx.is_distributed:
            self.save_agreed = save_due
            return self._flag.signum
        agreed = self.finish()
        local = torch.tensor([self._flag.signum, int(save_due)], dtype=torch.int32)
        work = dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self._ctx.control_group, async_op=True)
        self._pending = (work, local)
        # Only the first boundary waits for its own answer (a signal during start-up stops at the first step); every
        # later one reads the answer started one boundary before, so the step never waits for the all-reduce.
        first, self._first = self._first, False
        return self.finish() if first else agreed

    def finish(self) -> int:
        """Complete the outstanding all-reduce (before any other collective on the control group) and return it."""
        if not self._ctx.is_distributed:
            return self._flag.signum
        if self._pending is None:
            self.save_agreed = False
            return 0
        work, value = self._pending
        self._pending = None
        work.wait()
        signum, save = value.tolist()
        self.save_agreed = bool(save)
        return int(signum)


class CpuSyncBatchNorm(nn.BatchNorm2d):
    """``--sync-bn`` on CPU (gloo) runs: BatchNorm2d whose training-mode statistics are over all ranks' batches.

    PyTorch's SyncBatchNorm (used on CUDA) refuses CPU tensors; this is the same maths written with differentiable
    all-reduces, and a ``BatchNorm2d`` subclass with the same parameters and buffers, so checkpoints are identical
    either way. The all-reduces are autograd-aware (their backward all-reduces the gradients), so the gradient equals
    that of BatchNorm over the concatenated global batch. Evaluation mode uses the running statistics and
    communicates nothing.
    """

    def forward(self, input: Tensor) -> Tensor:
        if not (self.training and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(input)
        self._check_input_dim(input)
        dims = (0, 2, 3)
        # Statistics in float32 even under bf16 autocast, as BatchNorm's own kernels do.
        values = input.float()
        count = torch.tensor([values.numel() // values.shape[1]], dtype=values.dtype, device=values.device)
        # Two passes (mean, then squared deviations) avoid the cancellation of E[x^2] - E[x]^2.
        totals = all_reduce_with_grad(torch.cat([values.sum(dim=dims), count]))
        global_count = totals[-1]
        mean = totals[:-1] / global_count
        centered = values - mean.view(1, -1, 1, 1)
        var = all_reduce_with_grad(centered.square().sum(dim=dims)) / global_count
        output = centered * torch.rsqrt(var + self.eps).view(1, -1, 1, 1)
        if self.affine:
            output = output * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                # Like BatchNorm: the running variance is the unbiased estimate over the (global) batch.
                total = global_count.item()
                unbiased = var * (total / max(total - 1.0, 1.0))
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), momentum)
        return output.to(input.dtype)


def convert_sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """Replace the BatchNorm2d layers of ``model`` by a synchronised version suited to ``device`` (``--sync-bn``)."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for module in model.modules():
        if type(module) is nn.BatchNorm2d:
            module.__class__ = CpuSyncBatchNorm  # the same parameters and buffers: only the forward pass changes
    return model


# ----------------------------------------------------------------------------------------------------
# the way out of the entry scripts

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
        with contextlib.suppress(RuntimeError):  # DistError too: a rank is gone already, nothing left to wait for
            barrier(ctx)  # rank 0 has printed
    if quiet:
        # torchrun stops the others with SIGTERM once rank 0 has exited; the stop handler installed at the start would
        # take it as a request to save and sleep on, until torchrun's SIGKILL 30 s later.
        # Its SIGTERM may have come already, while the start-up handler only remembered it: then leave at once.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if not stopped_during_startup():
            time.sleep(QUIET_EXIT_DELAY_S if ctx is not None else QUIET_EXIT_BEFORE_JOINING_S)
