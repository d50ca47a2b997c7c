"""SLURM's notations (host lists, tasks per node, the derived port) and ``srun`` tasks as a launcher (pure plans)."""

from __future__ import annotations

import re
import signal

import pytest

from tests.helpers import launch_flags
from utils.errors import ConfigError
from utils.launch.environments import derived_port, first_host, launcher_rank, plan_launch


@pytest.mark.parametrize(
    ("hostlist", "first"),
    [
        ("gpu[01-03,07],cpu5", "gpu01"),
        ("localhost", "localhost"),
        ("node7", "node7"),
        ("a,b,c", "a"),
        ("gpu[8-11]", "gpu8"),
        ("gpu[008-010]", "gpu008"),
        ("rack[2-3]-gpu[1-2],rack1-gpu1", "rack2-gpu1"),
        ("n[3,1]-ib", "n3-ib"),
        ("x[5]", "x5"),
        ("node10-2,gpu[1-2]", "node10-2"),  # a range outside brackets is part of a name
    ],
)
def test_the_first_host_of_a_hostlist(hostlist: str, first: str) -> None:
    assert first_host(hostlist) == first


@pytest.mark.parametrize(
    "hostlist",
    ["gpu[01-03", "gpu01]", "gpu[3-1]", "a,gpu[2,5-4]", "gpu[a-b]", "gpu[]", "a,,b", "a,gpu[1-2", ""],
)
def test_bad_hostlists_name_the_variable_and_the_fix(hostlist: str) -> None:
    # The whole list is checked, not only the first host that the rendezvous needs.
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST=.* is not a host list SLURM writes.*set MASTER_ADDR"):
        first_host(hostlist)


def test_derived_port_is_in_range_and_stable() -> None:
    assert derived_port("123456") == 15000 + 123456 % 15000 == derived_port("123456")
    assert derived_port("1234_7") == derived_port("1234")  # array task ids
    assert all(15000 <= derived_port(str(job)) < 30000 for job in range(0, 100000, 997))
    with pytest.raises(ConfigError, match="SLURM_JOB_ID.*MASTER_PORT"):
        derived_port("abc")


def test_the_local_world_size_is_the_first_nodes_task_count() -> None:
    flags = launch_flags(ddp_mode=True)
    base = {"SLURM_PROCID": "0", "SLURM_NTASKS": "7", "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert plan_launch(flags, environ={**base, "SLURM_TASKS_PER_NODE": "4(x2),3"}).local_world_size == 4
    assert plan_launch(flags, environ={**base, "SLURM_STEP_TASKS_PER_NODE": "8"}).local_world_size == 8
    assert plan_launch(flags, environ=base).local_world_size == 7  # unknown: all of them


SRUN_TASK = {
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x4)",
}


def test_srun_tasks_are_a_launcher() -> None:
    plan = plan_launch(launch_flags(ddp_mode=True), environ=SRUN_TASK)
    assert plan.distributed
    assert (plan.rank, plan.world_size, plan.local_rank, plan.local_world_size) == (3, 8, 1, 2)
    assert plan.init_method == f"tcp://gpu07:{derived_port('4242')}"
    assert plan.slurm_job_id == "4242"
    assert launcher_rank(SRUN_TASK) == 3


def test_master_addr_and_port_override_the_derived_ones() -> None:
    plan = plan_launch(
        launch_flags(ddp_mode=True), environ={**SRUN_TASK, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
    )
    assert plan.init_method == "tcp://10.0.0.1:29400"


def test_torchrun_variables_win_over_slurm() -> None:
    environ = {**SRUN_TASK, "RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8",
               "MASTER_ADDR": "h", "MASTER_PORT": "1"}  # fmt: skip
    plan = plan_launch(launch_flags(ddp_mode=True), environ=environ)
    assert (plan.rank, plan.world_size, plan.local_rank, plan.init_method) == (5, 16, 5, "env://")
    assert plan.slurm_job_id == "4242"  # a requeue still names the job
    assert launcher_rank(environ) == 5


def test_without_ddp_mode_a_batch_script_is_one_process() -> None:
    # sbatch --ntasks=8 runs the script once with SLURM_NTASKS=8: it must not wait for seven ranks that never come.
    plan = plan_launch(launch_flags(ddp_mode=False), environ=SRUN_TASK)
    assert not plan.distributed
    assert plan.slurm_job_id == "4242"


def test_the_requeue_signal_is_handled_inside_a_slurm_job_only() -> None:
    assert plan_launch(launch_flags(ddp_mode=True), environ=SRUN_TASK).requeue_signal == signal.SIGUSR1
    assert plan_launch(launch_flags(requeue_signal="USR2"), environ=SRUN_TASK).requeue_signal == signal.SIGUSR2
    assert plan_launch(launch_flags(requeue_signal="none"), environ=SRUN_TASK).requeue_signal is None
    assert plan_launch(launch_flags(), environ={}).requeue_signal is None


def test_srun_tasks_without_ddp_mode_are_refused_on_every_task() -> None:
    for procid in ("0", "1"):
        environ = {**SRUN_TASK, "SLURM_PROCID": procid, "SLURM_STEP_NUM_TASKS": "2"}
        with pytest.raises(ConfigError, match=r"srun started 2 tasks of train.py without --ddp_mode.*add --ddp_mode"):
            plan_launch(launch_flags(ddp_mode=False), environ=environ)


def test_torchrun_per_srun_task_forming_its_own_group_is_refused() -> None:
    torchrun = {"TORCHELASTIC_RUN_ID": "1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "h", "MASTER_PORT": "1"}  # fmt: skip
    with pytest.raises(ConfigError, match=r"each run torchrun.*--ntasks-per-node=1"):
        plan_launch(launch_flags(ddp_mode=True), environ={**SRUN_TASK, **torchrun, "SLURM_STEP_NUM_TASKS": "2"})
    # One torchrun per node that joins the others (--nnodes): a larger world than its own workers.
    joined = {**torchrun, "WORLD_SIZE": "2"}
    plan = plan_launch(launch_flags(ddp_mode=True), environ={**SRUN_TASK, **joined, "SLURM_STEP_NUM_TASKS": "2"})
    assert plan.world_size == 2


def test_an_array_job_requeues_its_own_task() -> None:
    environ = {**SRUN_TASK, "SLURM_ARRAY_JOB_ID": "4240", "SLURM_ARRAY_TASK_ID": "2"}
    assert plan_launch(launch_flags(ddp_mode=True), environ=environ).slurm_job_id == "4240_2"


@pytest.mark.parametrize(
    ("missing", "named"),
    [("SLURM_JOB_NODELIST", "without SLURM_JOB_NODELIST, so rank 0's node is unknown; set MASTER_ADDR"),
     ("SLURM_JOB_ID", "without SLURM_JOB_ID, so no port can be derived; set MASTER_PORT")],
)  # fmt: skip
def test_a_task_without_the_variables_of_its_address_names_the_one_to_set(missing: str, named: str) -> None:
    environ = {name: value for name, value in SRUN_TASK.items() if name != missing}
    with pytest.raises(ConfigError, match=re.escape(named)):
        plan_launch(launch_flags(ddp_mode=True), environ=environ)
    # The step's own node list serves as well as the job's.
    step = {**SRUN_TASK, "SLURM_JOB_NODELIST": "", "SLURM_STEP_NODELIST": "gpu[09-10]"}
    assert plan_launch(launch_flags(ddp_mode=True), environ=step).init_method.startswith("tcp://gpu09:")
