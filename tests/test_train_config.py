"""train.py flags and launch decisions: parsing, validation messages, and who-am-I from the launcher's environment."""

from __future__ import annotations

import pytest

from utils.config import TrainConfig, parse_config, resolve_precision
from utils.distributed import plan_launch, threads_per_process
from utils.errors import ConfigError


def test_documented_flags_and_short_forms() -> None:
    config = parse_config(
        ["-e", "7", "-b", "3", "-l", "2e-4", "-f", "w.pth", "-s", "0.25", "-v", "20", "-c", "3", "--amp",
         "--bilinear", "--exp_name", "run1", "--save_every", "2", "--start_from", "4"]
    )  # fmt: skip
    assert (config.epochs, config.batch_size, config.learning_rate, config.load) == (7, 3, 2e-4, "w.pth")
    assert (config.scale, config.validation, config.classes) == (0.25, 20.0, 3)
    assert config.amp and config.bilinear
    assert (config.exp_name, config.save_every, config.start_from) == ("run1", 2, 4)
    # Underscored flags of the documented DDP script also accept dashes.
    assert parse_config(["--exp-name", "x", "--save-every", "3"]).save_every == 3


def test_milesial_defaults() -> None:
    config = parse_config([])
    assert (config.epochs, config.batch_size, config.learning_rate, config.scale) == (5, 1, 1e-5, 0.5)
    assert (config.validation, config.classes, config.optimizer, config.scheduler) == (10.0, 2, "adamw", "cosine")
    assert config.wandb == "disabled" and config.resume is None and config.grad_clip == 1.0


def test_resume_without_value_means_auto() -> None:
    assert parse_config(["--resume"]).resume == "auto"
    assert parse_config(["--resume", "ck/last.pth"]).resume == "ck/last.pth"


@pytest.mark.parametrize("flag", ["--local-rank=1", "--local_rank=1"])
def test_legacy_launcher_local_rank_argument(flag: str) -> None:
    # torch.distributed.launch appends --local-rank (older versions --local_rank) unless --use-env.
    assert parse_config(["--ddp_mode", flag]).local_rank == 1


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--scale", "0"], "--scale must be in"),
        (["--scale", "1.5"], "--scale must be in"),
        (["--validation", "0"], "--validation"),
        (["--validation", "100"], "--validation"),
        (["--epochs", "0"], "--epochs"),
        (["-b", "0"], "--batch-size"),
        (["--start_from", "9", "-e", "5"], r"pass --epochs 13"),
        (["--amp", "--precision", "fp32"], "--amp"),
        (["--load", "a.pth", "--resume"], "only one of them"),
        (["--rank", "0"], "--rank and --world-size"),
        (["--rank", "2", "--world-size", "2"], r"--rank must be in \[0, 1\]"),
        (["--dist-url", "tcp://h:1"], "--dist-url is for manual launches"),
        (["--grad-accum", "0"], "--grad-accum"),
        (["--exp_name", "a/b"], "--exp_name"),
        (["--epochs", "three"], "argument --epochs/-e: invalid int value"),
        (["--optimizer", "sgd"], "argument --optimizer: invalid choice"),
    ],
)
def test_invalid_flags_name_the_flag(argv: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_config(argv)


def test_precision_follows_amp_and_device() -> None:
    assert resolve_precision(TrainConfig(amp=True), "cuda") == "fp16"
    assert resolve_precision(TrainConfig(amp=True), "cpu") == "bf16"
    assert resolve_precision(TrainConfig(), "cpu") == "fp32"
    assert resolve_precision(TrainConfig(precision="bf16"), "cuda") == "bf16"
    with pytest.raises(ConfigError, match="--precision fp16 needs a CUDA device"):
        resolve_precision(TrainConfig(precision="fp16"), "cpu")


def test_single_process_without_launcher() -> None:
    plan = plan_launch(ddp_mode=False, environ={})
    assert not plan.distributed and plan.world_size == 1


def test_ddp_mode_without_launcher_shows_the_torchrun_command() -> None:
    with pytest.raises(ConfigError, match=r"torchrun --nproc_per_node=NUM_GPUS train.py --ddp_mode -e 3"):
        plan_launch(ddp_mode=True, environ={}, argv=["--ddp_mode", "-e", "3"])


def test_torchrun_environment() -> None:
    environ = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h"}
    plan = plan_launch(ddp_mode=True, environ=environ)
    assert plan.distributed and (plan.rank, plan.local_rank, plan.world_size, plan.local_world_size) == (5, 1, 8, 4)
    assert plan.init_method == "env://" and plan.warning is None


def test_several_processes_without_ddp_mode_switch_ddp_on() -> None:
    plan = plan_launch(ddp_mode=False, environ={"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"})
    assert plan.distributed and plan.rank == 1
    assert "DDP switched on" in plan.warning


def test_one_process_launcher_without_ddp_mode_stays_single() -> None:
    plan = plan_launch(ddp_mode=False, environ={"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    assert not plan.distributed


def test_legacy_launch_local_rank_from_the_flag() -> None:
    plan = plan_launch(ddp_mode=True, local_rank=1, environ={"RANK": "1", "WORLD_SIZE": "2"})
    assert plan.local_rank == 1
    # With --use-env the environment says it, and wins.
    plan = plan_launch(ddp_mode=True, local_rank=0, environ={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert plan.local_rank == 1


def test_manual_launch() -> None:
    plan = plan_launch(ddp_mode=True, rank=1, world_size=2, dist_url="tcp://10.0.0.1:29500", environ={})
    assert plan.distributed and (plan.rank, plan.world_size) == (1, 2)
    assert plan.init_method == "tcp://10.0.0.1:29500" and plan.local_rank == 1
    plan = plan_launch(ddp_mode=True, rank=0, world_size=2, environ={"MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert plan.init_method == "env://"
    with pytest.raises(ConfigError, match="MASTER_ADDR and MASTER_PORT, or pass --dist-url"):
        plan_launch(ddp_mode=True, rank=0, world_size=2, environ={})


def test_bad_launcher_variable_is_named() -> None:
    with pytest.raises(ConfigError, match="WORLD_SIZE='two'"):
        plan_launch(ddp_mode=True, environ={"RANK": "0", "WORLD_SIZE": "two"})


def test_threads_split_the_cores_between_local_processes() -> None:
    assert threads_per_process(2, 2) == 1
    assert threads_per_process(16, 4) == 4
    assert threads_per_process(2, 8) == 1
    assert threads_per_process(8, 1) == 8
