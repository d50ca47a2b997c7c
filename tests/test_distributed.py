"""utils.launch.environments: who-am-I from the launcher's environment or the flags, without processes."""

from __future__ import annotations

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
