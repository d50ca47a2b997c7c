"""Distributed set-up: the only module that reads the launcher's environment.

Supported launches, all through the same ``train.py``:

* ``python train.py``: one process, no process group;
* ``torchrun [--nnodes M --node_rank R --rdzv-backend c10d --rdzv-endpoint HOST:PORT] --nproc_per_node N train.py
  --ddp_mode``: rank, local rank and world size from ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``;
* ``python -m torch.distributed.launch --nproc_per_node N train.py --ddp_mode`` (legacy): the same environment, plus
  ``--local-rank`` on the command line unless ``--use-env``;
* manual: one ``python train.py --ddp_mode --rank R --world-size W`` per GPU, rendezvous through ``MASTER_ADDR`` and
  ``MASTER_PORT`` or ``--dist-url tcp://HOST:PORT``;
* SLURM tasks: ``srun python train.py --ddp_mode`` (one task per GPU, no torchrun): rank, world size and local rank
  from ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``, rendezvous at ``MASTER_ADDR`` or else the first host of
  ``SLURM_JOB_NODELIST``, on ``MASTER_PORT`` or else a port derived from ``SLURM_JOB_ID`` (``utils.slurm``). Only with
  ``--ddp_mode``: a batch script's plain ``python train.py`` also sees ``SLURM_NTASKS`` but is one process. torchrun's
  variables win when both are present (torchrun started by srun). docs/CLUSTERS.md.

A launcher that starts several processes without ``--ddp_mode`` switches DDP on (with a warning) rather than running
N independent trainings that overwrite each other's checkpoints.

torchrun restarts (``--max-restarts``): the agent keeps one store for the whole job, so the addresses the workers of a
failed attempt published there are still present when the next attempt starts, and gloo/NCCL would connect to the dead
processes. Each attempt therefore works in its own namespace of that store (``TORCHELASTIC_RESTART_COUNT``). That
count is per machine: on several machines, run torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` so every
attempt gets a new store instead (docs/RELIABILITY.md, "What survives a crash").
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from utils import errors, slurm
from utils.errors import ConfigError, UserError
from utils.hardware import available_cpus, pick_device, threads_per_process

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

# What launchers (torchrun, torch.distributed.launch, a manual launch) set to make a process a rank. A program that
# starts its own training processes (tests, the benchmark) removes these so a child never mistakes itself for one.
LAUNCHER_ENV_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_JOB_ID",
    "SLURM_JOB_NODELIST",
    "SLURM_STEP_NODELIST",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
)


@dataclass(frozen=True)
class LaunchPlan:
    """Who this process is, decided from flags and the launcher's environment before anything is initialised."""

    distributed: bool
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    init_method: str = "env://"
    warning: str | None = None
    master_address: str | None = None
    """HOST:PORT of the rendezvous store of an ``env://`` launch (MASTER_ADDR/MASTER_PORT)."""
    store_namespace: str | None = None
    """Key prefix of this torchrun attempt in the agent's store (which outlives restarted workers); None otherwise."""
    restart_count: int = 0
    """How many times torchrun restarted the workers before this attempt (``--max-restarts``); 0 without torchrun."""
    supervised: bool = False
    """This process is a worker of torchrun's agent, its parent: when the agent dies, nobody else will stop it."""
    slurm_job_id: str | None = None
    """``SLURM_JOB_ID`` when the process runs inside a SLURM job (whatever started it): the job a requeue names."""
    slurm_tasks: bool = False
    """srun's tasks are the ranks (``SLURM_PROCID``/``SLURM_NTASKS``), not torchrun's workers."""


@dataclass
class DistributedContext:
    """This process's place in the job; ``is_main`` (global rank 0) is the only writer of files and logs."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str | None = None
    # A second (gloo, CPU) group for small control messages, so they never wait behind gradient traffic or force a
    # GPU synchronisation.
    control_group: Any = None
    restart_count: int = 0
    """torchrun restarts before this attempt (see ``LaunchPlan.restart_count``)."""
    slurm_job_id: str | None = None
    """The SLURM job this process runs in (see ``LaunchPlan.slurm_job_id``)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.backend is not None


def plan_launch(
    *,
    ddp_mode: bool,
    rank: int | None = None,
    world_size: int | None = None,
    dist_url: str | None = None,
    local_rank: int | None = None,
    environ: Mapping[str, str] | None = None,
    argv: Sequence[str] = (),
) -> LaunchPlan:
    """Decide single-process or DDP from the flags and the environment (pure: ``environ`` defaults to os.environ)."""
    environ = os.environ if environ is None else environ
    plan = _plan_launch(
        ddp_mode=ddp_mode,
        rank=rank,
        world_size=world_size,
        dist_url=dist_url,
        local_rank=local_rank,
        environ=environ,
        argv=argv,
    )
    job_id = environ.get("SLURM_JOB_ID") or None
    return dataclasses.replace(plan, slurm_job_id=job_id) if job_id else plan


def _plan_launch(
    *,
    ddp_mode: bool,
    rank: int | None,
    world_size: int | None,
    dist_url: str | None,
    local_rank: int | None,
    environ: Mapping[str, str],
    argv: Sequence[str],
) -> LaunchPlan:
    env_local_rank = _env_int(environ, "LOCAL_RANK")
    env_local_world = _env_int(environ, "LOCAL_WORLD_SIZE")

    if rank is not None and world_size is not None:
        # Manual launch: the flags say who we are; the address comes from --dist-url or MASTER_ADDR/MASTER_PORT.
        if dist_url is None and not ("MASTER_ADDR" in environ and "MASTER_PORT" in environ):
            raise ConfigError(
                "--rank/--world-size need a rendezvous address: set MASTER_ADDR and MASTER_PORT, or pass "
                "--dist-url tcp://HOST:PORT (the same on every process)"
            )
        resolved_local = _first_set(env_local_rank, local_rank, rank)
        # Without a launcher nobody says how many ranks share this machine; assuming all of them only makes the
        # per-process CPU thread count smaller, never oversubscribed.
        local_world = _first_set(env_local_world, world_size)
        return LaunchPlan(
            distributed=True,
            rank=rank,
            local_rank=resolved_local,
            world_size=world_size,
            local_world_size=local_world,
            init_method=dist_url or "env://",
            warning=None if ddp_mode else "--rank/--world-size given without --ddp_mode: DDP switched on",
            master_address=None if dist_url else _master_address(environ),
        )

    env_rank, env_world = _env_int(environ, "RANK"), _env_int(environ, "WORLD_SIZE")
    if env_rank is not None and env_world is not None:
        resolved_local = _first_set(env_local_rank, local_rank, 0)
        local_world = _first_set(env_local_world, env_world)
        warning = None
        if env_world > 1 and not ddp_mode:
            warning = (
                f"launched as {env_world} processes without --ddp_mode: DDP switched on so the processes train one "
                f"model together instead of {env_world} runs overwriting each other's checkpoints"
            )
        return LaunchPlan(
            distributed=ddp_mode or warning is not None,
            rank=env_rank,
            local_rank=resolved_local,
            world_size=env_world,
            local_world_size=local_world,
            init_method="env://",
            warning=warning,
            master_address=_master_address(environ),
            store_namespace=_attempt_namespace(environ),
            restart_count=_env_int(environ, "TORCHELASTIC_RESTART_COUNT") or 0,
            supervised="TORCHELASTIC_RUN_ID" in environ,
        )

    if ddp_mode and "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        return _slurm_plan(environ)

    if ddp_mode:
        shown = shlex.join([arg for arg in argv if not arg.startswith(("--local-rank", "--local_rank"))])
        raise ConfigError(
            "--ddp_mode needs a launcher that starts one process per GPU and sets RANK/WORLD_SIZE; run: "
            f"torchrun --nproc_per_node=NUM_GPUS train.py {shown}".rstrip()
            + " (or give each process --rank R --world-size W with --dist-url tcp://HOST:PORT)"
        )
    return LaunchPlan(distributed=False, local_rank=_first_set(env_local_rank, local_rank, 0))


def _slurm_plan(environ: Mapping[str, str]) -> LaunchPlan:
    """``srun python train.py --ddp_mode``: every task is one rank; the rendezvous is on the job's first node."""
    world = _env_int(environ, "SLURM_NTASKS") or 1
    task_rank = _env_int(environ, "SLURM_PROCID") or 0
    local = _env_int(environ, "SLURM_LOCALID") or 0
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE") or ""
    local_world = slurm.tasks_on_first_node(per_node) or world
    host = environ.get("MASTER_ADDR") or None
    if host is None:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise ConfigError(
                "srun started this task without SLURM_JOB_NODELIST, so rank 0's node is unknown; set MASTER_ADDR"
            )
        host = slurm.first_host(nodelist)
    port = _env_int(environ, "MASTER_PORT")
    if port is None:
        job_id = environ.get("SLURM_JOB_ID")
        if not job_id:
            raise ConfigError("srun started this task without SLURM_JOB_ID, so no port can be derived; set MASTER_PORT")
        port = slurm.derived_port(job_id)
    return LaunchPlan(
        distributed=True,
        rank=task_rank,
        local_rank=local,
        world_size=world,
        local_world_size=local_world,
        init_method=f"tcp://{host}:{port}",
        slurm_tasks=True,
    )


def setup(
    plan: LaunchPlan, *, device_request: str = "auto", timeout_s: float = 1800.0, threads: int = 0
) -> DistributedContext:
    """Pick the device, size the CPU thread pool, and join the process group when the plan is distributed."""
    device = pick_device(device_request, local_rank=plan.local_rank, distributed=plan.distributed)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(threads or threads_per_process(available_cpus(), plan.local_world_size))
    if plan.warning:
        logger.warning(plan.warning)
    if not plan.distributed:
        return DistributedContext(
            0, plan.local_rank, 1, 1, device, restart_count=plan.restart_count, slurm_job_id=plan.slurm_job_id
        )

    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if plan.store_namespace is not None and plan.master_address is not None:
            host, port = plan.master_address.rsplit(":", 1)
            # torchrun's agent serves this store; a client of it, with keys of this attempt only.
            agent_store = dist.TCPStore(host, int(port), plan.world_size, is_master=False, timeout=timeout)
            dist.init_process_group(
                backend=backend,
                store=dist.PrefixStore(plan.store_namespace, agent_store),
                rank=plan.rank,
                world_size=plan.world_size,
                timeout=timeout,
            )
        else:
            dist.init_process_group(
                backend=backend,
                init_method=plan.init_method,
                rank=plan.rank,
                world_size=plan.world_size,
                timeout=timeout,
            )
    except dist.DistError as error:
        raise ConfigError(_rendezvous_failure(plan, timeout_s, error)) from error
    # The timeout must be given again: a new group does not inherit it and would wait 30 minutes for a dead rank.
    control_group = dist.new_group(backend="gloo", timeout=timeout)
    return DistributedContext(
        rank=plan.rank,
        local_rank=plan.local_rank,
        world_size=plan.world_size,
        local_world_size=plan.local_world_size,
        device=device,
        backend=backend,
        control_group=control_group,
        restart_count=plan.restart_count,
        slurm_job_id=plan.slurm_job_id,
    )


def rendezvous_address(plan: LaunchPlan) -> str:
    """HOST:PORT where the ranks of ``plan`` meet (rank 0, or torchrun's agent, listens there)."""
    if plan.init_method.startswith("tcp://"):
        return plan.init_method[len("tcp://") :]
    return plan.master_address or plan.init_method


def _rendezvous_failure(plan: LaunchPlan, timeout_s: float, error: Exception) -> str:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    flags = "--dist-url" if plan.init_method.startswith("tcp://") else "MASTER_ADDR/MASTER_PORT"
    if plan.slurm_tasks:
        flags = "MASTER_ADDR (else SLURM_JOB_NODELIST's first host) and MASTER_PORT (else derived from SLURM_JOB_ID)"
    return (
        f"rank {plan.rank} could not join the other {plan.world_size - 1} process(es) at {rendezvous_address(plan)} "
        f"within --dist-timeout {timeout_s:g} s ({reason}); check that {flags} names rank 0's machine and a free, "
        f"reachable port, and start every rank within --dist-timeout"
    )


def teardown(ctx: DistributedContext) -> None:
    if ctx.is_distributed and dist.is_initialized():
        dist.destroy_process_group()


def barrier(ctx: DistributedContext) -> None:
    """Wait for every rank (on the CPU control group, so no GPU stream is involved)."""
    if ctx.is_distributed:
        dist.barrier(group=ctx.control_group)


def broadcast_from_main(ctx: DistributedContext, value: Any) -> Any:
    """Rank 0's ``value`` on every rank (small picklable objects: paths, scores)."""
    if not ctx.is_distributed:
        return value
    box = [value if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0, group=ctx.control_group)
    return box[0]


def sum_across_ranks(ctx: DistributedContext, values: torch.Tensor) -> torch.Tensor:
    """Element-wise sum over ranks of a small tensor (on the training device, at log steps only)."""
    if ctx.is_distributed:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def decide_on_main(ctx: DistributedContext, decide: Callable[[], _T]) -> _T:
    """Run ``decide`` on global rank 0 only and return its result on every rank; its UserError is raised everywhere."""
    outcome: tuple[str, Any, str] | None = None
    if ctx.is_main:
        try:
            outcome = ("ok", decide(), "")
        except UserError as error:
            outcome = ("error", type(error).__name__, str(error))
    outcome = broadcast_from_main(ctx, outcome)
    if outcome[0] == "error":
        raise raised_on_every_rank(_user_error(outcome[1], outcome[2]))
    return outcome[1]


def agree_on_errors(ctx: DistributedContext, build: Callable[[], _T]) -> _T:
    """Run ``build`` on every rank; if it raises a UserError on any rank, raise the lowest such rank's on all."""
    result, failure = None, None
    try:
        result = build()
    except UserError as error:
        failure = error
    if not ctx.is_distributed:
        if failure is not None:
            raise failure
        return result
    # One integer all-reduce decides; the messages travel (pickled, dearer) only when some rank failed, so this is
    # cheap enough to guard every batch the training loop fetches.
    failed = torch.tensor([failure is not None], dtype=torch.int32)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=ctx.control_group)
    if not failed.item():
        return result
    reports: list[Any] = [None] * ctx.world_size
    mine = None if failure is None else (type(failure).__name__, str(failure))
    dist.all_gather_object(reports, mine, group=ctx.control_group)
    for rank, report in enumerate(reports):
        if report is not None:
            if rank == ctx.rank:
                raise raised_on_every_rank(failure)
            raise raised_on_every_rank(_user_error(report[0], f"rank {rank}: {report[1]}"))
    return result


def raised_on_every_rank(error: UserError) -> UserError:
    """Mark ``error`` as raised with the same message on every rank, so that only global rank 0 needs to print it."""
    error.on_every_rank = True  # type: ignore[attr-defined]
    return error


def is_raised_on_every_rank(error: BaseException) -> bool:
    return bool(getattr(error, "on_every_rank", False))


def launcher_rank(environ: Mapping[str, str] | None = None) -> int:
    """The global rank a launcher gave this process (``RANK``, else srun's ``SLURM_PROCID``), 0 without one.

    For deciding who prints an error found before the launch plan exists (a bad flag: every rank has the same).
    """
    environ = os.environ if environ is None else environ
    try:
        return int(environ.get("RANK") or environ.get("SLURM_PROCID") or 0)
    except ValueError:
        return 0


def _user_error(type_name: str, message: str) -> UserError:
    error_type = getattr(errors, type_name, UserError)
    if not (isinstance(error_type, type) and issubclass(error_type, UserError)):
        error_type = UserError
    return error_type(message)


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError as error:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer; check the launcher") from error


def _master_address(environ: Mapping[str, str]) -> str | None:
    if "MASTER_ADDR" in environ and "MASTER_PORT" in environ:
        return f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}"
    return None


def _attempt_namespace(environ: Mapping[str, str]) -> str | None:
    """A store key prefix per torchrun attempt, when the workers share the agent's store (see the module docstring)."""
    restart_count = _env_int(environ, "TORCHELASTIC_RESTART_COUNT")
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or restart_count is None:
        return None
    return f"unet-ddp/attempt{restart_count}/"


def _first_set(*values: int | None) -> int:
    for value in values:
        if value is not None:
            return value
    raise AssertionError("the last value is always set")
