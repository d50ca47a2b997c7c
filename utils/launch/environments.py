"""Launch environments: which launcher started this process and who the process is; the only reader of the
launcher's variables.

One small interface, ``LaunchEnvironment`` (as Lightning's ClusterEnvironment), and one class per launcher, all through
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
every task (``_refuse_wrong_srun``): srun tasks without ``--ddp_mode``, and several torchruns each forming a group of
its own. The requeue names an array job's own task (``SLURM_ARRAY_JOB_ID``_``SLURM_ARRAY_TASK_ID``).

torchrun restarts (``--max-restarts``): the agent keeps one store for the whole job, so the addresses the workers of a
failed attempt published there are still present when the next attempt starts, and gloo/NCCL would connect to the dead
processes. Each attempt therefore works in its own namespace of that store (``TORCHELASTIC_RESTART_COUNT``). That
count is per machine: on several machines, run torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` so every
attempt gets a new store instead (docs/RELIABILITY.md, "What survives a crash").

``plan_launch`` reads the distributed flags from the config it is given (``ddp_mode``, ``rank``, ``world_size``,
``dist_url``, ``local_rank``) and the variables from a mapping, so that it is pure: environment in, plan out, tested
without processes. SLURM's notations (host lists, tasks per node) are parsed here too, without SLURM.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from utils.errors import ConfigError

if TYPE_CHECKING:
    from utils.training.config import LaunchSection


class LaunchValueError(ConfigError):
    """A launch value of this process (its rank, world size, local rank, address) is wrong: the process itself says
    so, whatever its rank (other processes may have other values)."""


# Rendezvous port of a job started by srun without MASTER_PORT: every task of a job must compute the same one without
# talking to the others, and two jobs sharing a node should rarely collide, so it comes from the job id. The range
# stays above the well-known and registered ports most clusters use and below Linux's ephemeral range (32768+), from
# which the kernel picks the ports of outgoing connections.
DERIVED_PORT_BASE = 15000
DERIVED_PORT_SPAN = 15000
DEFAULT_ADDRESS_HINT = "MASTER_ADDR/MASTER_PORT"


ENV_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
"""The variables of PyTorch's ``env://`` convention (torchrun's and the legacy launcher's)."""


def is_launcher_variable(name: str) -> bool:
    """Whether a launcher sets the environment variable ``name`` (torchrun, the legacy launcher, SLURM). A program that
    starts its own training processes (tests, the benchmark) removes them all, so that a child never mistakes itself
    for a rank."""
    return name in ENV_VARIABLES or name.startswith(("TORCHELASTIC_", "SLURM_"))


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
    """HOST:PORT where rank 0 (or torchrun's agent) serves the rendezvous store: MASTER_ADDR and MASTER_PORT, SLURM's
    first node and derived port, or ``--dist-url tcp://HOST:PORT``'s."""
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
    address_hint: str = DEFAULT_ADDRESS_HINT
    """What names the rendezvous address, for the message when the ranks cannot meet there."""


class Given(NamedTuple):
    """A launch value and its source as messages name it (``--rank``, ``environment variable RANK``)."""

    value: int
    name: str


def _value(config: LaunchSection, environ: Mapping[str, str], source: str) -> int | None:
    """The integer in ``source``, a flag (``--rank``) or an environment variable; None where it is not set."""
    if source.startswith("--"):
        return getattr(config, source[2:].replace("-", "_"))
    return _env_int(environ, source)


def _given(config: LaunchSection, environ: Mapping[str, str], *sources: str, default: int) -> Given:
    """The first of ``sources`` that is set; ``default`` under the last one's name when none is."""
    source = next((source for source in sources if _value(config, environ, source) is not None), sources[-1])
    value = _value(config, environ, source)
    name = source if source.startswith("--") else f"environment variable {source}"
    return Given(default if value is None else value, name)


class LaunchEnvironment:
    """One launcher, as Lightning's ClusterEnvironment: ``detect`` says whether it started this process, the other
    methods who the process is and where the ranks meet. A source of a value is a flag (``--rank``) or an environment
    variable; the defaults are PyTorch's ``env://`` convention."""

    rank_source, world_size_source, local_rank_source = "RANK", "WORLD_SIZE", "LOCAL_RANK"
    address_hint = DEFAULT_ADDRESS_HINT
    supervised = False
    """Its processes are workers of a supervising agent, their parent (torchrun's): ``stop_when_orphaned``."""

    def __init__(self, config: LaunchSection, environ: Mapping[str, str]) -> None:
        self.config, self.environ = config, environ

    @classmethod
    def detect(cls, config: LaunchSection, environ: Mapping[str, str]) -> bool:
        """Whether this launcher started the process: by default, whether it gave a rank and a world size."""
        return None not in (_value(config, environ, cls.rank_source), _value(config, environ, cls.world_size_source))

    def given(self, *sources: str, default: int) -> Given:
        return _given(self.config, self.environ, *sources, default=default)

    def rank(self) -> Given:
        return self.given(self.rank_source, default=0)

    def world_size(self) -> Given:
        return self.given(self.world_size_source, default=1)

    def local_rank(self) -> Given:
        # --local-rank: the legacy launcher without --use-env; --rank: a manual launch (one machine, by default).
        return self.given(self.local_rank_source, "--local-rank", "--rank", default=0)

    def local_world_size(self) -> Given:
        """The local rank's bound: LOCAL_WORLD_SIZE where the launcher sets it, else the world size."""
        return self.given("LOCAL_WORLD_SIZE", self.world_size_source, default=1)

    def processes_here(self) -> int:
        """The ranks on this machine, which share its CPUs: where no launcher says, assuming all of them only makes the
        per-process CPU thread count smaller, never oversubscribed."""
        return self.local_world_size().value or 1

    def rendezvous(self, host: str | None, port: int | None) -> tuple[str, str | None]:
        """The init method, and the HOST:PORT where rank 0 (or torchrun's agent) serves it (None where none is named),
        from MASTER_ADDR/MASTER_PORT's ``host`` and ``port``."""
        return "env://", f"{host}:{port}" if host is not None and port is not None else None

    def restart_count(self) -> int:
        return 0

    def warning(self) -> str | None:
        world = self.world_size().value
        if self.config.ddp_mode or world <= 1:
            return None
        return (
            f"launched as {world} processes without --ddp_mode: DDP switched on so the processes train one model "
            f"together instead of {world} runs overwriting each other's checkpoints"
        )


class ManualLaunch(LaunchEnvironment):
    """``--rank R --world-size W`` on every process; the ranks meet at --dist-url or MASTER_ADDR/MASTER_PORT."""

    rank_source, world_size_source = "--rank", "--world-size"

    @property
    def address_hint(self) -> str:  # type: ignore[override]
        return "--dist-url" if self.config.dist_url else DEFAULT_ADDRESS_HINT

    def rendezvous(self, host: str | None, port: int | None) -> tuple[str, str | None]:
        if self.config.dist_url:
            return self.config.dist_url, _dist_url_address(self.config.dist_url)
        if host is None or port is None:
            raise ConfigError(
                "--rank/--world-size need a rendezvous address: set MASTER_ADDR and MASTER_PORT, or pass "
                "--dist-url tcp://HOST:PORT (the same on every process)"
            )
        return super().rendezvous(host, port)

    def warning(self) -> str | None:
        return None if self.config.ddp_mode else "--rank/--world-size given without --ddp_mode: DDP switched on"


class LegacyLaunch(LaunchEnvironment):
    """``python -m torch.distributed.launch`` or another launcher that sets RANK/WORLD_SIZE without torchrun's agent;
    the legacy launcher passes ``--local-rank`` too, unless ``--use-env`` (LOCAL_RANK, when set, wins)."""


class TorchElastic(LegacyLaunch):
    """torchrun: the same variables, and an agent that supervises the workers and restarts them (``--max-restarts``)."""

    supervised = True

    @classmethod
    def detect(cls, config: LaunchSection, environ: Mapping[str, str]) -> bool:
        return "TORCHELASTIC_RUN_ID" in environ and super().detect(config, environ)

    def restart_count(self) -> int:
        return _env_int(self.environ, "TORCHELASTIC_RESTART_COUNT", 0)


class SlurmTasks(LaunchEnvironment):
    """``srun python train.py --ddp_mode``: every task is one rank; the ranks meet on the job's first node. Only with
    --ddp_mode: a batch script's own ``python train.py`` sees SLURM_NTASKS too but is one process."""

    rank_source, world_size_source, local_rank_source = "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"
    address_hint = "MASTER_ADDR (else SLURM_JOB_NODELIST's first host) and MASTER_PORT (else derived from SLURM_JOB_ID)"

    @classmethod
    def detect(cls, config: LaunchSection, environ: Mapping[str, str]) -> bool:
        return config.ddp_mode and super().detect(config, environ)

    def processes_here(self) -> int:
        # srun says it per node: "4(x2),3" is 4 tasks on the first node.
        per_node = self.environ.get("SLURM_STEP_TASKS_PER_NODE") or self.environ.get("SLURM_TASKS_PER_NODE") or ""
        first_node = re.match(r"\d+", per_node.strip())
        return int(first_node.group()) if first_node else super().processes_here()

    def rendezvous(self, host: str | None, port: int | None) -> tuple[str, str | None]:
        nodes = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
        host = host or first_host(_needed(self.environ, *nodes, why="rank 0's node is unknown; set MASTER_ADDR"))
        if port is None:
            port = derived_port(_needed(self.environ, "SLURM_JOB_ID", why="no port can be derived; set MASTER_PORT"))
        return f"tcp://{host}:{port}", f"{host}:{port}"


class SingleProcess(LaunchEnvironment):
    """``python train.py``: no launcher, one process (its ``--local-rank`` or LOCAL_RANK still picks the GPU)."""

    @classmethod
    def detect(cls, config: LaunchSection, environ: Mapping[str, str]) -> bool:
        return not config.ddp_mode


LAUNCHERS = (ManualLaunch, TorchElastic, LegacyLaunch, SlurmTasks, SingleProcess)
"""In order of precedence: the flags, then torchrun's or the legacy launcher's variables, then srun's."""


def plan_launch(
    config: LaunchSection, *, environ: Mapping[str, str] | None = None, argv: Sequence[str] = ()
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
    rank, world = launcher.rank(), launcher.world_size()
    local_rank, local_world = launcher.local_rank(), launcher.local_world_size()
    _refuse_wrong_srun(launcher, environ, world.value, launcher.processes_here())
    warning = launcher.warning()
    distributed = config.ddp_mode or warning is not None
    init_method, master_address = "env://", None
    if distributed:  # a single process needs no address: a stray MASTER_PORT must not stop it
        _check_ranks(rank, world, local_rank, local_world)
        port = _env_int(environ, "MASTER_PORT")
        if port is not None and not 0 < port < 65536:
            raise LaunchValueError(
                f"environment variable MASTER_PORT={port} is not a port (1..65535); choose a free port"
            )
        init_method, master_address = launcher.rendezvous(environ.get("MASTER_ADDR") or None, port)
    restarts = launcher.restart_count()
    # A store key prefix per attempt, when the workers share the agent's store (see the module docstring).
    shared_store = launcher.supervised and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    # The job a requeue names (scontrol requeue): an array job's own task (1234_7), else SLURM_JOB_ID.
    array_job, array_task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    slurm_job_id = f"{array_job}_{array_task}" if array_job and array_task else environ.get("SLURM_JOB_ID") or None
    requeue = slurm_job_id is not None and config.requeue_signal != "none"
    return LaunchPlan(
        distributed=distributed,
        rank=rank.value,
        local_rank=local_rank.value,
        world_size=world.value or 1,
        local_world_size=launcher.processes_here(),
        init_method=init_method,
        warning=warning,
        master_address=master_address,
        store_namespace=f"unet-ddp/attempt{restarts}/" if shared_store else None,
        restart_count=restarts,
        supervised=launcher.supervised,
        slurm_job_id=slurm_job_id,
        requeue_signal=int(signal.Signals[f"SIG{config.requeue_signal}"]) if requeue else None,
        address_hint=launcher.address_hint,
    )


def _check_ranks(rank: Given, world: Given, local_rank: Given, local_world: Given) -> None:
    """Refuse, at once and naming the variable or flag, a world size below 1, a rank outside ``0..world size - 1``,
    a local rank below 0 or not below the local world size (``LOCAL_WORLD_SIZE`` where the launcher sets it, else
    the world size): otherwise the process group would wait its whole --dist-timeout for ranks that can never come."""
    if world.value < 1:
        raise LaunchValueError(
            f"{world.name}={world.value} is not a number of processes (1 or more); check the launcher"
        )
    for value, limit in ((rank, world), (local_rank, local_world)):
        if not 0 <= value.value < limit.value:
            raise LaunchValueError(
                f"{value.name}={value.value} is outside 0..{limit.value - 1} ({limit.name}={limit.value}); check the "
                "launcher"
            )


def _dist_url_address(dist_url: str) -> str | None:
    """HOST:PORT of ``--dist-url tcp://HOST:PORT`` (None for a ``file://`` or ``env://`` store); any other form is
    refused."""
    url = urllib.parse.urlsplit(dist_url)
    if url.scheme in ("file", "env"):
        return None
    try:
        host, port = url.hostname, url.port
    except ValueError:  # a port that is no number
        host = port = None
    if url.scheme != "tcp" or not (host and port):
        raise LaunchValueError(f"--dist-url {dist_url} is not tcp://HOST:PORT; name rank 0's host and a port")
    return f"{host}:{port}"


def _refuse_wrong_srun(launcher: LaunchEnvironment, environ: Mapping[str, str], world: int, local_world: int) -> None:
    """Refuse what srun started wrongly, on every task: only srun steps set ``SLURM_STEP_NUM_TASKS`` (a batch script's
    own ``python train.py`` sees ``SLURM_NTASKS`` but is one process)."""
    step_tasks = _env_int(environ, "SLURM_STEP_NUM_TASKS") or 1
    if step_tasks > 1 and isinstance(launcher, TorchElastic) and world == local_world:
        raise ConfigError(
            f"srun started {step_tasks} tasks that each run torchrun, and each torchrun formed a group of its own "
            f"{world} worker(s): run one srun task per node (--ntasks-per-node=1) with torchrun "
            "--nnodes=$SLURM_NNODES --nproc_per_node=GPUS_PER_NODE --rdzv-backend=c10d "
            "--rdzv-endpoint=FIRST_HOST:29500, or srun tasks without torchrun (srun python train.py --ddp_mode)"
        )
    if step_tasks > 1 and isinstance(launcher, SingleProcess):
        raise ConfigError(
            f"srun started {step_tasks} tasks of train.py without --ddp_mode (each would train alone into the same "
            "run folder): add --ddp_mode so that the tasks train one model together, or run one task (srun --ntasks=1)"
        )


def launcher_rank(environ: Mapping[str, str] | None = None) -> int:
    """The global rank a launcher gave this process (``RANK``, else srun's ``SLURM_PROCID``), 0 without one.

    For deciding who prints an error found before the launch plan exists (a bad flag: every rank has the same).
    """
    environ = os.environ if environ is None else environ
    rank = environ.get("RANK") or environ.get("SLURM_PROCID") or "0"
    return int(rank) if rank.isdigit() else 0  # a malformed one is plan_launch's to refuse, naming it


# SLURM's host list: names separated by commas, each with bracket groups of numbers and ranges (gpu[01-03,07],cpu5).
_HOST_PATTERN = r"(?:[^,\[\]]|\[\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*\])+"


def first_host(hostlist: str) -> str:
    """The first host of a SLURM host list, as ``scontrol show hostnames`` names it: ``gpu[01-03,07],cpu5`` -> gpu01.

    The whole list must be one SLURM writes: comma-separated names with bracketed numbers and ranges N-M (N <= M),
    several bracket groups in one name (``rack[1-2]-gpu[1-2]``), a suffix after them, zero padding kept. Anything else
    is a ConfigError naming the variable.
    """
    ranges = re.findall(r"(\d+)-(\d+)(?=[^\[]*\])", hostlist)  # those inside brackets
    if not re.fullmatch(rf"{_HOST_PATTERN}(?:,{_HOST_PATTERN})*", hostlist) or any(
        int(low) > int(high) for low, high in ranges
    ):
        raise ConfigError(
            f"environment variable SLURM_JOB_NODELIST={hostlist!r} is not a host list SLURM writes (comma-separated "
            "names with bracketed numbers and ranges N-M, N <= M: gpu[01-03,07],cpu5); set MASTER_ADDR to the first "
            "node's name instead"
        )
    first = re.match(_HOST_PATTERN, hostlist)
    assert first is not None  # the list matched
    return re.sub(r"\[(\d+)[^\]]*\]", r"\1", first.group())


def derived_port(job_id: str) -> int:
    """The rendezvous port of job ``job_id``: ``15000 + job_id % 15000`` (15000..29999; see DERIVED_PORT_BASE)."""
    digits = job_id.split("_", 1)[0]  # an array task's id reads "1234_7"; SLURM_JOB_ID itself is a plain number
    if not digits.isdigit():
        raise ConfigError(f"environment variable SLURM_JOB_ID={job_id!r} is not a job number; set MASTER_PORT instead")
    return DERIVED_PORT_BASE + int(digits) % DERIVED_PORT_SPAN


def _needed(environ: Mapping[str, str], *names: str, why: str) -> str:
    """The first of srun's variables ``names`` that is set; without any, a ConfigError naming the last and ``why`` it
    is needed."""
    value = next((environ[name] for name in names if environ.get(name)), None)
    if value is None:
        raise ConfigError(f"srun started this task without {names[-1]}, so {why}")
    return value


def _env_int(environ: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    """The integer in variable ``name``, ``default`` where it is unset or empty."""
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as error:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer; check the launcher") from error
