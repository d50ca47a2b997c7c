"""utils.launch.environments: who-am-I from the launcher's environment or the flags, without processes."""

from __future__ import annotations

import re

import pytest

from tests.helpers import launch_flags
from utils.errors import ConfigError
from utils.launch.environments import plan_launch


def test_single_process_without_launcher() -> None:
    plan = plan_launch(launch_flags(ddp_mode=False), environ={})
    assert not plan.distributed and plan.world_size == 1


def test_ddp_mode_without_launcher_shows_the_torchrun_command() -> None:
    with pytest.raises(ConfigError, match=r"torchrun --nproc_per_node=NUM_GPUS train.py --ddp_mode -e 3"):
        plan_launch(launch_flags(ddp_mode=True), environ={}, argv=["--ddp_mode", "-e", "3"])


def test_torchrun_environment() -> None:
    environ = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h"}
    plan = plan_launch(launch_flags(ddp_mode=True), environ=environ)
    assert plan.distributed and (plan.rank, plan.local_rank, plan.world_size, plan.local_world_size) == (5, 1, 8, 4)
    assert plan.init_method == "env://" and plan.warning is None


def test_several_processes_without_ddp_mode_switch_ddp_on() -> None:
    plan = plan_launch(launch_flags(ddp_mode=False), environ={"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"})
    assert plan.distributed and plan.rank == 1
    assert "DDP switched on" in plan.warning


def test_one_process_launcher_without_ddp_mode_stays_single() -> None:
    plan = plan_launch(launch_flags(ddp_mode=False), environ={"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    assert not plan.distributed


def test_legacy_launch_local_rank_from_the_flag() -> None:
    plan = plan_launch(launch_flags(ddp_mode=True, local_rank=1), environ={"RANK": "1", "WORLD_SIZE": "2"})
    assert plan.local_rank == 1
    # With --use-env the environment says it, and wins.
    plan = plan_launch(
        launch_flags(ddp_mode=True, local_rank=0), environ={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    )
    assert plan.local_rank == 1


def test_manual_launch() -> None:
    plan = plan_launch(launch_flags(ddp_mode=True, rank=1, world_size=2, dist_url="tcp://10.0.0.1:29500"), environ={})
    assert plan.distributed and (plan.rank, plan.world_size) == (1, 2)
    assert plan.init_method == "tcp://10.0.0.1:29500" and plan.local_rank == 1
    plan = plan_launch(
        launch_flags(ddp_mode=True, rank=0, world_size=2), environ={"MASTER_ADDR": "h", "MASTER_PORT": "1"}
    )
    assert plan.init_method == "env://"
    with pytest.raises(ConfigError, match="MASTER_ADDR and MASTER_PORT, or pass --dist-url"):
        plan_launch(launch_flags(ddp_mode=True, rank=0, world_size=2), environ={})


def test_bad_launcher_variable_is_named() -> None:
    with pytest.raises(ConfigError, match="WORLD_SIZE='two'"):
        plan_launch(launch_flags(ddp_mode=True), environ={"RANK": "0", "WORLD_SIZE": "two"})


def test_each_torchrun_attempt_uses_its_own_namespace_of_the_agents_store() -> None:
    # torchrun's agent keeps one store across restarts; the keys of a failed attempt must be invisible to the next.
    environ = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500",
               "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_USE_AGENT_STORE": "True"}  # fmt: skip
    first = plan_launch(launch_flags(ddp_mode=True), environ={**environ, "TORCHELASTIC_RESTART_COUNT": "0"})
    second = plan_launch(launch_flags(ddp_mode=True), environ={**environ, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert first.master_address == second.master_address == "localhost:29500"
    assert first.store_namespace and second.store_namespace and first.store_namespace != second.store_namespace
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a new store per attempt, nothing to separate.
    fresh = {**environ, "TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_RESTART_COUNT": "1"}
    assert plan_launch(launch_flags(ddp_mode=True), environ=fresh).store_namespace is None


@pytest.mark.parametrize(
    ("flags", "environ", "named"),
    [
        ({}, {"SLURM_PROCID": "-1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"},
         "environment variable SLURM_PROCID=-1 is outside 0..1"),
        ({}, {"SLURM_PROCID": "5", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"},
         "environment variable SLURM_PROCID=5 is outside 0..1 (environment variable SLURM_NTASKS=2)"),
        ({}, {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
         "environment variable RANK=2 is outside 0..1"),
        ({}, {"RANK": "0", "WORLD_SIZE": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
         "environment variable WORLD_SIZE=0 is not a number of processes"),
        ({}, {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h"},
         "environment variable LOCAL_RANK=2 is outside 0..1 (environment variable LOCAL_WORLD_SIZE=2)"),
        ({}, {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1", "MASTER_ADDR": "h"},
         "environment variable LOCAL_RANK=-1 is outside 0..1"),
        ({}, {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "3", "SLURM_JOB_ID": "7",
              "SLURM_JOB_NODELIST": "n1"}, "environment variable SLURM_LOCALID=3 is outside 0..1"),
        ({"rank": 3, "world_size": 2, "dist_url": "tcp://h:1"}, {}, "--rank=3 is outside 0..1 (--world-size=2)"),
        ({"rank": 0, "world_size": 2, "local_rank": 5, "dist_url": "tcp://h:1"}, {}, "--local-rank=5 is outside"),
        ({}, {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"},
         "MASTER_PORT=70000 is not a port"),
    ],
)  # fmt: skip
def test_launch_values_out_of_range_are_one_line_naming_the_variable(flags, environ, named) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        plan_launch(launch_flags(ddp_mode=True, **flags), environ=environ)


def test_launch_values_in_range_pass_and_slurm_nodes_of_other_sizes_too() -> None:
    # "2,4": the second node's local ids run to 3, above the first node's count; only the world size bounds them.
    environ = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "3", "SLURM_JOB_ID": "7",
               "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2,4"}  # fmt: skip
    plan = plan_launch(launch_flags(ddp_mode=True), environ=environ)
    assert (plan.rank, plan.local_rank, plan.world_size) == (5, 3, 6)


def test_a_rendezvous_host_that_does_not_resolve_is_named_with_where_it_came_from() -> None:
    from utils.launch.process_group import check_rendezvous_host

    environ = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29500"}
    with pytest.raises(ConfigError, match=r"invalid' \(from MASTER_ADDR/MASTER_PORT\) cannot be resolved"):
        check_rendezvous_host(plan_launch(launch_flags(ddp_mode=True), environ=environ))
    check_rendezvous_host(plan_launch(launch_flags(ddp_mode=True), environ={**environ, "MASTER_ADDR": "127.0.0.1"}))
    for dist_url in ("tcp://localhost", "http://h:1", "h:1"):
        manual = launch_flags(ddp_mode=True, rank=0, world_size=2, dist_url=dist_url)
        with pytest.raises(ConfigError, match=f"--dist-url {dist_url} is not tcp://HOST:PORT"):
            plan_launch(manual, environ={})
    store = plan_launch(launch_flags(ddp_mode=True, rank=0, world_size=2, dist_url="file:///tmp/store"), environ={})
    assert store.init_method == "file:///tmp/store" and store.master_address is None  # no host to check
    check_rendezvous_host(store)
