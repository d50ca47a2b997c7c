"""train.py flags (utils.training.config): parsing, defaults and validation messages."""

from __future__ import annotations

import pytest

from utils.errors import ConfigError
from utils.training.config import parse_config


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


def test_defaults_are_milesials_flags_with_this_projects_optimizer_and_schedule() -> None:
    config = parse_config([])
    # milesial/Pytorch-UNet's train.py defaults:
    assert (config.epochs, config.batch_size, config.learning_rate, config.scale) == (5, 1, 1e-5, 0.5)
    assert (config.validation, config.classes) == (10.0, 2)
    # This project's own: AdamW with a cosine schedule (milesial's RMSprop + ReduceLROnPlateau is
    # --optimizer rmsprop --scheduler plateau).
    assert (config.optimizer, config.scheduler) == ("adamw", "cosine")
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
