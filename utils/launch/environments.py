"""Launch environments: which launcher started this process and who the process is; the only reader of the
launcher's variables.

One small interface, ``LaunchEnvironment`` (as Lightning's ClusterEnvironment), and one class per launch, all through
the same ``train.py``:

* ``python train.py``: one process, no process group (``SingleProcess``);
* ``torchrun [--nnodes M --node_rank R --rdzv-backend c10d --rdzv-endpoint HOST:PORT] --nproc_per_node N train.py
  --ddp_mode``: rank, local rank and world size from ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` (``TorchElastic``);
* ``python -m torch.distributed.launch --nproc_per_node N train.py --ddp_mode`` (legacy), or any launcher that sets
  ``RANK``/``WORLD_SIZE`` without torchrun's agent: the same variables, plus ``--local-rank`` on the command line
  unless ``--use-env`` (``LegacyLaunch``);
* manual: one ``python train.py --ddp_mode --rank R --world-size W`` per GPU, rendezvous through ``MASTER_ADDR`` and
  ``MASTER_PORT`` or ``--dist-url tcp://HOST:PORT`` (``ManualLaunch``);
* SLURM tasks: ``srun python train.py --ddp_mode`` (one task per GPU, no torchrun): rank, world size and local rank
  from ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``, rendezvous at ``MASTER_ADDR`` or else the first host of
  ``SLURM_JOB_NODELIST``, on ``MASTER_PORT`` or else a port derived from ``SLURM_JOB_ID`` (``SlurmTasks``). Only with
  ``--ddp_mode``: a batch script's plain ``python train.py`` also sees ``SLURM_NTASKS`` but is one process. torchrun's
  variables win when both are present (torchrun started by srun). docs/CLUSTERS.md.

A launcher that starts several processes without ``--ddp_mode`` switches DDP on (with a warning) rather than running
N independent trainings that overwrite each other's checkpoints. Two launches under srun are refused with one line on
every task (``wrong_srun_launch``): srun tasks without ``--ddp_mode``, and several torchruns each forming a group of
its own. The requeue names an array job's own task (``SLURM_ARRAY_JOB_ID``_``SLURM_ARRAY_TASK_ID``).

torchrun restarts (``--max-restarts``): the agent keeps one store for the whole job, so the addresses the workers of a
failed attempt published there are still present when the next attempt starts, and gloo/NCCL would connect to the dead
processes. Each attempt therefore works in its own namespace of that store (``TORCHELASTIC_RESTART_COUNT``). That
count is per machine: on several machines, run torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` so every
attempt gets a new store instead (docs/RELIABILITY.md, "What survives a crash").

The environments read the distributed flags from the config they are given (``ddp_mode``, ``rank``, ``world_size``,
``dist_url``, ``local_rank``) and the variables from a mapping, so that ``plan_launch`` is pure: environment in, plan
out, tested without processes. SLURM's notations (host lists, tasks per node) are parsed here too, without SLURM.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from utils.errors import ConfigError

if TYPE_CHECKING:
    from utils.training.config import TrainConfig


class LaunchValueError(ConfigError):
    """A launch value of this process (its rank, world size, local rank, address) is wrong: the process itself says
    so, whatever its rank (other processes may have other values)."""


# Rendezvous port of a job started by srun without MASTER_PORT: every task of a job must compute the same one without
# talking to the others, and two jobs sharing a node should rarely collide, so it comes from the job id. The range
# stays above the well-known and registered ports most clusters use and below Linux's ephemeral range (32768+), from
# which the kernel picks the ports of outgoing connections.
DERIVED_PORT_BASE = 15000
DERIVED_PORT_SPAN = 15000


@dataclass(frozen=True)
class LaunchPlan:
    """Who this process is, decided from flags and the launcher's environment before anything is initialised."""

    distributed: bool = False
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    init_method: str = "env://"
    warning: str | None = None
    master_address: str | None = None
    """HOST:PORT where rank 0 (or torchrun's agent) serves the rendezvous store, as the launcher names it (MASTER_ADDR
    and MASTER_PORT, or SLURM's first node and derived port); a ``--dist-url`` names its own in ``init_method``."""
    store_namespace: str | None = None
    """Key prefix of this torchrun attempt in the agent's store (which outlives restarted workers); None otherwise."""
    restart_count: int = 0
    """How many times torchrun restarted the workers before this attempt (``--max-restarts``); 0 without torchrun."""
    supervised: bool = False
    """This process is a worker of torchrun's agent, its parent: when the agent dies, nobody else will stop it."""
    slurm_job_id: str | None = None
    """``SLURM_JOB_ID`` when the process runs inside a SLURM job (whatever started it): the job a requeue names."""
    requeue_signal: int | None = None
    """Inside a SLURM job, the signal that saves, requeues the job and exits (``--requeue-signal``); else None."""
    address_hint: str = "MASTER_ADDR/MASTER_PORT"
    """What names the rendezvous address, for the message when the ranks cannot meet there."""


class LaunchEnvironment:
    """One launcher: ``detect`` says whether it started this process, the other methods who the process is.

    The defaults read the variables of PyTorch's ``env://`` convention; srun's tasks name their rank variables
    otherwise and derive the rendezvous address.
    """

    variables: tuple[str, ...] = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    """The variables this launcher sets. A program that starts its own training processes (tests, the benchmark)
    removes all of them (``LAUNCHER_ENV_VARIABLES``) so that a child never mistakes itself for a rank."""
    rank_variable, world_size_variable, local_rank_variable = "RANK", "WORLD_SIZE", "LOCAL_RANK"
    address_hint = LaunchPlan.address_hint
    supervised = False

    def __init__(self, config: TrainConfig, environ: Mapping[str, str]) -> None:
        self.config = config
        self.environ = environ

    @classmethod
    def detect(cls, config: TrainConfig, environ: Mapping[str, str]) -> bool:
        """Whether this launcher started the process: by default, whether its rank and world size variables are set."""
        return all(_env_int(environ, name) is not None for name in (cls.rank_variable, cls.world_size_variable))

    def rank(self) -> int:
        return _env_int(self.environ, self.rank_variable) or 0

    def world_size(self) -> int:
        return _env_int(self.environ, self.world_size_variable) or 1

    def local_rank(self) -> int:
        # --local-rank: the legacy launcher without --use-env; --rank: a manual launch (one machine, by default).
        flag = self.config.local_rank if self.config.local_rank is not None else self.config.rank or 0
        return _env_int(self.environ, self.local_rank_variable, flag)

    def local_world_size(self) -> int:
        # Where no launcher says how many ranks share this machine, assuming all of them only makes the per-process
        # CPU thread count smaller, never oversubscribed.
        return _env_int(self.environ, "LOCAL_WORLD_SIZE", self.world_size())

    def master_address(self) -> str | None:
        return self.environ.get("MASTER_ADDR") or None

    def master_port(self) -> int | None:
        return _env_int(self.environ, "MASTER_PORT")

    def init_method(self) -> str:
        return "env://"

    def restart_count(self) -> int:
        return 0

    def store_namespace(self) -> str | None:
        return None

    def warning(self) -> str | None:
        world = self.world_size()
        if world > 1 and not self.config.ddp_mode:
            return (
                f"launched as {world} processes without --ddp_mode: DDP switched on so the processes train one "
                f"model together instead of {world} runs overwriting each other's checkpoints"
            )
        return None


class ManualLaunch(LaunchEnvironment):
    """``--rank R --world-size W`` on every process: the flags say who it is; the address comes from --dist-url or
    MASTER_ADDR/MASTER_PORT."""

    variables = ()

    @classmethod
    def detect(cls, config: TrainConfig, environ: Mapping[str, str]) -> bool:
        return config.rank is not None and config.world_size is not None

    @property
    def address_hint(self) -> str:  # type: ignore[override]
        return "--dist-url" if self.config.dist_url else LaunchPlan.address_hint

    def rank(self) -> int:
        return self.config.rank

    def world_size(self) -> int:
        return self.config.world_size

    def init_method(self) -> str:
        if self.config.dist_url:
            return self.config.dist_url
        if self.master_address() is None or self.master_port() is None:
            raise ConfigError(
                "--rank/--world-size need a rendezvous address: set MASTER_ADDR and MASTER_PORT, or pass "
                "--dist-url tcp://HOST:PORT (the same on every process)"
            )
        return "env://"

    def warning(self) -> str | None:
        return None if self.config.ddp_mode else "--rank/--world-size given without --ddp_mode: DDP switched on"


class LegacyLaunch(LaunchEnvironment):
    """``python -m torch.distributed.launch`` or another launcher that sets RANK/WORLD_SIZE without torchrun's agent;
    the legacy launcher passes ``--local-rank`` too, unless ``--use-env`` (LOCAL_RANK, when set, wins)."""

    variables = ("RANK", "WORLD_SIZE", "GROUP_RANK")


class TorchElastic(LegacyLaunch):
    """torchrun: the same variables, and an agent that supervises the workers and restarts them (``--max-restarts``)."""

    variables = ("TORCHELASTIC_RUN_ID",)
    supervised = True

    @classmethod
    def detect(cls, config: TrainConfig, environ: Mapping[str, str]) -> bool:
        return "TORCHELASTIC_RUN_ID" in environ and super().detect(config, environ)

    def restart_count(self) -> int:
        return _env_int(self.environ, "TORCHELASTIC_RESTART_COUNT", 0)

    def store_namespace(self) -> str | None:
        """A store key prefix per attempt, when the workers share the agent's store (see the module docstring)."""
        if self.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return None
        return f"unet-ddp/attempt{self.restart_count()}/"


class SlurmTasks(LaunchEnvironment):
    """``srun python train.py --ddp_mode``: every task is one rank; the rendezvous is on the job's first node."""

    variables = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_JOB_NODELIST",
                 "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_STEP_NUM_TASKS",
                 "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID")  # fmt: skip
    rank_variable, world_size_variable, local_rank_variable = "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"
    address_hint = "MASTER_ADDR (else SLURM_JOB_NODELIST's first host) and MASTER_PORT (else derived from SLURM_JOB_ID)"

    @classmethod
    def detect(cls, config: TrainConfig, environ: Mapping[str, str]) -> bool:
        return config.ddp_mode and super().detect(config, environ)

    def local_world_size(self) -> int:
        per_node = self.environ.get("SLURM_STEP_TASKS_PER_NODE") or self.environ.get("SLURM_TASKS_PER_NODE") or ""
        return tasks_on_first_node(per_node) or self.world_size()

    def master_address(self) -> str:
        if (host := super().master_address()) is not None:
            return host
        nodes = self._needed(
            "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", why="rank 0's node is unknown; set MASTER_ADDR"
        )
        return expand_hostlist(nodes)[0]

    def master_port(self) -> int:
        if (port := super().master_port()) is not None:
            return port
        return derived_port(self._needed("SLURM_JOB_ID", why="no port can be derived; set MASTER_PORT"))

    def init_method(self) -> str:
        return f"tcp://{self.master_address()}:{self.master_port()}"

    def _needed(self, *names: str, why: str) -> str:
        """The first of srun's variables ``names`` that is set; without any, a ConfigError naming the last and ``why``
        it is needed."""
        value = next((self.environ[name] for name in names if self.environ.get(name)), None)
        if value is None:
            raise ConfigError(f"srun started this task without {names[-1]}, so {why}")
        return value


class SingleProcess(LaunchEnvironment):
    """``python train.py``: no launcher, one process (its ``--local-rank`` or LOCAL_RANK still picks the GPU)."""

    variables = ()

    @classmethod
    def detect(cls, config: TrainConfig, environ: Mapping[str, str]) -> bool:
        return not config.ddp_mode


LAUNCHERS = (ManualLaunch, TorchElastic, LegacyLaunch, SlurmTasks, SingleProcess)
"""In order of precedence: the flags, then torchrun's or the legacy launcher's variables, then srun's."""
LAUNCHER_ENV_VARIABLES = tuple(
    dict.fromkeys(name for kind in (LaunchEnvironment, *LAUNCHERS) for name in kind.variables)
)


def plan_launch(
    config: TrainConfig, *, environ: Mapping[str, str] | None = None, argv: Sequence[str] = ()
) -> LaunchPlan:
    """Decide single-process or DDP from the flags and the environment (pure: ``environ`` defaults to os.environ)."""
    environ = os.environ if environ is None else environ
    launcher = next((kind(config, environ) for kind in LAUNCHERS if kind.detect(config, environ)), None)
    if launcher is None:
        shown = shlex.join([arg for arg in argv if not arg.startswith(("--local-rank", "--local_rank"))])
        raise ConfigError(
            "--ddp_mode needs a launcher that starts one process per GPU and sets RANK/WORLD_SIZE; run: "
            f"torchrun --nproc_per_node=NUM_GPUS train.py {shown}".rstrip()
            + " (or give each process --rank R --world-size W with --dist-url tcp://HOST:PORT)"
        )
    wrong_srun_launch(launcher)
    # The job a requeue names (scontrol requeue): an array job's own task (1234_7), else SLURM_JOB_ID.
    array_job, array_task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    slurm_job_id = f"{array_job}_{array_task}" if array_job and array_task else environ.get("SLURM_JOB_ID") or None
    requeue = slurm_job_id is not None and config.requeue_signal != "none"
    warning = launcher.warning()
    distributed = config.ddp_mode or warning is not None
    if distributed:
        check_launch_values(launcher)
    # A single process needs no address: a stray MASTER_PORT must not stop it.
    host, port = (launcher.master_address(), launcher.master_port()) if distributed else (None, None)
    return LaunchPlan(
        distributed=distributed,
        rank=launcher.rank(),
        local_rank=launcher.local_rank(),
        world_size=launcher.world_size(),
        local_world_size=launcher.local_world_size(),
        init_method=launcher.init_method() if distributed else "env://",
        warning=warning,
        master_address=f"{host}:{port}" if host is not None and port is not None else None,
        store_namespace=launcher.store_namespace(),
        restart_count=launcher.restart_count(),
        supervised=launcher.supervised,
        slurm_job_id=slurm_job_id,
        requeue_signal=int(signal.Signals[f"SIG{config.requeue_signal}"]) if requeue else None,
        address_hint=launcher.address_hint,
    )


def check_launch_values(launcher: LaunchEnvironment) -> None:
    """Refuse, at once and naming the variable or flag, a world size below 1, a rank outside ``0..world size - 1``,
    a local rank below 0 or not below the local world size (``LOCAL_WORLD_SIZE`` where the launcher sets it, else
    the world size), or a port outside 1..65535: otherwise the process group would wait its whole --dist-timeout
    for ranks that can never come."""
    environ, manual = launcher.environ, isinstance(launcher, ManualLaunch)
    rank_name = "--rank" if manual else f"environment variable {launcher.rank_variable}"
    world_name = "--world-size" if manual else f"environment variable {launcher.world_size_variable}"
    # world_size() reads 0 as 1; a launcher found by its variables has set them (and --world-size is at least 1)
    world = launcher.world_size() if manual else _env_int(environ, launcher.world_size_variable)
    if world < 1:
        raise LaunchValueError(f"{world_name}={world} is not a number of processes (1 or more); check the launcher")
    local_world = _env_int(environ, "LOCAL_WORLD_SIZE")
    local_limit, limit_name = (local_world, "LOCAL_WORLD_SIZE") if local_world is not None else (world, world_name)
    local_name = "--local-rank" if launcher.config.local_rank is not None else rank_name
    if _env_int(environ, launcher.local_rank_variable) is not None:
        local_name = f"environment variable {launcher.local_rank_variable}"
    ranks = (
        (rank_name, launcher.rank(), world, world_name),
        (local_name, launcher.local_rank(), local_limit, limit_name),
    )
    for name, value, limit, limit_of in ranks:
        if not 0 <= value < limit:
            raise LaunchValueError(f"{name}={value} is outside 0..{limit - 1} ({limit_of}={limit}); check the launcher")
    port = _env_int(environ, "MASTER_PORT")
    if port is not None and not 0 < port < 65536:
        raise LaunchValueError(f"environment variable MASTER_PORT={port} is not a port (1..65535); choose a free port")


def wrong_srun_launch(launcher: LaunchEnvironment) -> None:
    """Refuse what srun started wrongly, on every task: only srun steps set ``SLURM_STEP_NUM_TASKS`` (a batch script's
    own ``python train.py`` sees ``SLURM_NTASKS`` but is one process)."""
    step_tasks = _env_int(launcher.environ, "SLURM_STEP_NUM_TASKS") or 1
    if step_tasks <= 1:
        return
    if isinstance(launcher, TorchElastic) and (world := launcher.world_size()) == launcher.local_world_size():
        raise ConfigError(
            f"srun started {step_tasks} tasks that each run torchrun, and each torchrun formed a group of its own "
            f"{world} worker(s): run one srun task per node (--ntasks-per-node=1) with torchrun "
            "--nnodes=$SLURM_NNODES --nproc_per_node=GPUS_PER_NODE --rdzv-backend=c10d "
            "--rdzv-endpoint=FIRST_HOST:29500, or srun tasks without torchrun (srun python train.py --ddp_mode)"
        )
    if isinstance(launcher, SingleProcess):
        raise ConfigError(
            f"srun started {step_tasks} tasks of train.py without --ddp_mode (each would train alone into the same "
            "run folder): add --ddp_mode so that the tasks train one model together, or run one task (srun --ntasks=1)"
        )


def launcher_rank(environ: Mapping[str, str] | None = None) -> int:
    """The global rank a launcher gave this process (``RANK``, else srun's ``SLURM_PROCID``), 0 without one.

    For deciding who prints an error found before the launch plan exists (a bad flag: every rank has the same).
    """
    environ = os.environ if environ is None else environ
    try:
        return int(environ.get("RANK") or environ.get("SLURM_PROCID") or 0)
    except ValueError:
        return 0


def expand_hostlist(hostlist: str) -> list[str]:
    """The host names of a SLURM host list, in order: ``gpu[01-03,07],cpu5`` -> gpu01 gpu02 gpu03 gpu07 cpu5.

    Supports what ``scontrol show hostnames`` does for the lists SLURM writes: comma-separated names, each with
    bracketed ranges and single numbers (zero padding kept), several bracket groups in one name
    (``rack[1-2]-gpu[1-2]``), and a suffix after the brackets. Anything else is a ConfigError naming the variable.
    """
    hosts: list[str] = []
    # A name runs to the next comma outside brackets; an unclosed '[' takes the rest of the list, and is refused below.
    names = [name.strip() for name in re.findall(r"(?:\[[^\]]*\]?|[^,\[])+", hostlist)]
    for name in filter(None, names):
        # Odd pieces are the contents of the bracket groups, even ones the text around them.
        pieces = re.split(r"\[([^\[\]]*)\]", name)
        for text in pieces[::2]:
            if "[" in text or "]" in text:
                raise _bad_hostlist(hostlist, "a '[' is not closed" if "[" in text else "a ']' closes no '['")
        choices = [_expand_ranges(piece, hostlist) if index % 2 else [piece] for index, piece in enumerate(pieces)]
        hosts.extend("".join(parts) for parts in itertools.product(*choices))
    if not hosts:
        raise _bad_hostlist(hostlist, "it names no host")
    return hosts


def derived_port(job_id: str) -> int:
    """The rendezvous port of job ``job_id``: ``15000 + job_id % 15000`` (15000..29999; see DERIVED_PORT_BASE)."""
    digits = job_id.split("_", 1)[0]  # an array task's id reads "1234_7"; SLURM_JOB_ID itself is a plain number
    if not digits.isdigit():
        raise ConfigError(f"environment variable SLURM_JOB_ID={job_id!r} is not a job number; set MASTER_PORT instead")
    return DERIVED_PORT_BASE + int(digits) % DERIVED_PORT_SPAN


def tasks_on_first_node(tasks_per_node: str) -> int | None:
    """The task count of the first node in ``SLURM_STEP_TASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE`` (``4(x2),3``)."""
    match = re.match(r"(\d+)", tasks_per_node.strip())
    return int(match.group(1)) if match else None


def _expand_ranges(ranges: str, hostlist: str) -> list[str]:
    numbers = []
    for part in ranges.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not match:
            raise _bad_hostlist(hostlist, f"[{ranges}] holds {part!r}, not a number or a range N-M")
        low_text, high_text = match.group(1), match.group(2) or match.group(1)
        if int(high_text) < int(low_text):
            raise _bad_hostlist(hostlist, f"the range {part!r} runs backwards")
        width = len(low_text)  # gpu[01-10]: the padding of the first number is the padding of all of them
        numbers.extend(str(number).zfill(width) for number in range(int(low_text), int(high_text) + 1))
    return numbers


def _bad_hostlist(hostlist: str, reason: str) -> ConfigError:
    return ConfigError(
        f"environment variable SLURM_JOB_NODELIST={hostlist!r} is not a host list SLURM writes ({reason}); set "
        f"MASTER_ADDR to the first node's name instead"
    )


def _env_int(environ: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    """The integer in variable ``name``, ``default`` where it is unset or empty."""
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as error:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer; check the launcher") from error
