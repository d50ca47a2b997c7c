"""train.py flags (utils.training.config): parsing, defaults and validation messages."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from utils.errors import ConfigError
from utils.training.config import TrainConfig, parse_config


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
        (["--scale", "0"], r"--scale must be a finite number in \(0, 1\]"),
        (["--scale", "1.5"], r"--scale must be a finite number in \(0, 1\]"),
        (["--validation", "0"], "--validation"),
        (["--validation", "100"], "--validation"),
        (["--epochs", "0"], "--epochs"),
        (["-b", "0"], "--batch-size"),
        (["--amp", "--precision", "fp32"], "--amp"),
        (["--load", "a.pth", "--resume"], "only one of them"),
        (["--rank", "0"], "--rank and --world-size"),
        (["--rank", "2", "--world-size", "2"], r"--rank must be in \[0, 1\]"),
        (["--dist-url", "tcp://h:1"], "--dist-url is for manual launches"),
        (["--grad-accum", "0"], "--grad-accum"),
        (["--exp_name", "a/b"], "--exp_name"),
        (["--epochs", "three"], "argument --epochs/-e: invalid int value"),
        (["--optimizer", "sgd"], "argument --optimizer: invalid choice"),
        (["--start_from", "0"], "--start_from must be at least 1"),
        # Numbers that parse but cannot train: infinite, NaN, or finite and absurd.
        (["-l", "inf"], r"--learning-rate must be a finite number in \(0, 1\], got inf"),
        (["-l", "1e308"], r"--learning-rate must be a finite number in \(0, 1\], got 1e\+308"),
        (["-l", "nan"], "--learning-rate must be a finite number"),
        (["-l", "0"], "--learning-rate must be a finite number"),
        (["--weight-decay", "inf"], r"--weight-decay must be a finite number in \[0, 1\], got inf"),
        (["--weight-decay=-1e-4"], "--weight-decay must be a finite number"),
        (["--momentum", "nan"], r"--momentum must be a finite number in \[0, 1\), got nan"),
        (["--momentum", "1"], "--momentum must be a finite number"),
        (["--grad-clip", "inf"], "--grad-clip must be a finite number at least 0"),
        (["--dist-timeout", "inf"], r"--dist-timeout must be a finite number in \(0, 604800\] seconds"),
        (["--dist-timeout", "0"], "--dist-timeout must be a finite number"),
        (["--scale", "nan"], "--scale must be a finite number in"),
        (["-v", "inf"], "--validation must be a finite number in"),
        (["--seed", "-1"], r"--seed must be in 0\.\.4294967295, got -1"),
        (["--seed", "4294967296"], r"--seed must be in 0\.\.4294967295, got 4294967296"),
        (["--local-rank", "-1"], "--local-rank must not be negative"),
    ],
)
def test_invalid_flags_name_the_flag(argv: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_config(argv)


def test_epochs_count_from_start_from_as_the_ddp_script() -> None:
    # --start_from 9 --epochs 5 trains epochs 9..13 (it used to be refused: --epochs was the last epoch's number).
    config = parse_config(["--start_from", "9", "-e", "5"])
    assert (config.start_from, config.epochs) == (9, 5)
    assert parse_config(["--start_from", "2", "-e", "1"]).epochs == 1


def test_largest_accepted_values() -> None:
    config = parse_config(["-l", "1", "--weight-decay", "1", "--momentum", "0.99", "--seed", str(2**32 - 1)])
    assert (config.learning_rate, config.weight_decay, config.seed) == (1.0, 1.0, 2**32 - 1)
    assert parse_config(["--dist-timeout", "604800", "--grad-clip", "0"]).dist_timeout == 604800


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--epoch", "1"], r"unrecognized arguments: --epoch 1; did you mean --epochs\?"),
        (["--learning-rat=1e-3"], r"did you mean --learning-rate\?"),
        (["--save-evry", "2"], r"did you mean --save-every\?"),
        (["--frobnicate"], r"unrecognized arguments: --frobnicate \(see python train.py --help\)$"),
    ],
)
def test_abbreviations_are_refused_and_typos_get_a_suggestion(argv: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_config(argv)


def test_help_is_grouped() -> None:
    from utils.training.config import HELP_GROUPS, build_parser

    text = build_parser().format_help()
    positions = [text.index(f"\n{group}:\n") for group in HELP_GROUPS]
    assert positions == sorted(positions)
    # Each flag is listed under its group: the text between a group's title and the next one's.
    ends = [*positions[1:], len(text)]
    sections = {group: text[start:end] for group, start, end in zip(HELP_GROUPS, positions, ends, strict=True)}
    for group, flag in [
        ("data", "--imgs"),
        ("model", "--base-channels"),
        ("optimisation", "--learning-rate"),
        ("distributed", "--dist-timeout"),
        ("checkpoints", "--start_from"),
        ("logging", "--log-every"),
        ("performance", "--channels-last"),
    ]:
        assert flag in sections[group], (group, flag)
    assert "options:" in text and "--help" in text.split("\ndata:\n")[0]


# Component configs and the builders that fill them from the flags. A field named like a flag (or renamed here) mirrors
# it; any other field is derived from flags by its builder and checked by hand below.
COMPONENT_RENAMES = {"name": "optimizer", "n_classes": "classes"}
# Named like their flags but resolved before the builder sees them (--precision follows --amp and the device;
# --class-weights auto needs the training masks): derived too.
RESOLVED_FIELDS = {"precision", "class_weights"}
# Every mirrored flag away from its default, valid together (a resnet encoder for --freeze-encoder-epochs).
NON_DEFAULT_ARGV = [
    "--imgs", "i", "--masks", "m", "-s", "0.25", "-v", "20", "-c", "3", "--augment", "--seed", "7", "-b", "3",
    "--pixel-cache", "px", "--ignore-value", "255", "--ignore-value", "254", "--split-by", "prefix",
    "--group-pattern", "^(.+)_", "--folds", "4", "--fold", "2",
    "--optimizer", "rmsprop", "-l", "3e-3", "--weight-decay", "0.01", "--momentum", "0.5", "--scheduler", "poly",
    "--warmup-steps", "3", "--grad-clip", "0.5", "--channels-last", "--encoder", "resnet18",
    "--freeze-encoder-epochs", "2", "--start_from", "4",
    "--val-every", "2", "--save_every", "3", "--keep-last", "4", "--save-every-steps", "5", "--log-every", "6",
    "--max-steps", "7", "--max-nonfinite-steps", "8", "--save-every-minutes", "1.5", "--keep-best", "2",
    "--no-progress", "--val-mode", "sharded", "--patience", "3", "--min-delta", "0.1",
]  # fmt: skip


def _built_components(argv: list[str]) -> dict[type, Any]:
    from utils.training.build_loaders import data_config
    from utils.training.build_optimization import optimizer_config, step_config

    config = parse_config(argv)
    built = [
        data_config(config),
        optimizer_config(config),
        step_config(config, "bf16", (1.0, 2.0, 3.0)),
    ]
    return {type(component): component for component in built}


def test_component_configs_repeat_no_flag_default_and_their_builders_pass_the_flags() -> None:
    # A component's config has no defaults of its own: the flag's is the one default, so they can never disagree.
    config = parse_config(NON_DEFAULT_ARGV)
    defaults = TrainConfig()
    mirrored = 0
    for component_type, component in _built_components(NON_DEFAULT_ARGV).items():
        for field in dataclasses.fields(component_type):
            assert field.default is dataclasses.MISSING, (component_type.__name__, field.name)
            assert field.default_factory is dataclasses.MISSING, (component_type.__name__, field.name)
            source = COMPONENT_RENAMES.get(field.name, field.name)
            if not hasattr(defaults, source) or field.name in RESOLVED_FIELDS:
                continue  # derived from flags: checked below
            flag_value = getattr(config, source)
            assert flag_value != getattr(defaults, source), f"NON_DEFAULT_ARGV leaves {source} at its default"
            expected = tuple(flag_value) if isinstance(flag_value, list) else flag_value
            assert getattr(component, field.name) == expected, (component_type.__name__, field.name)
            mirrored += 1
    assert mirrored == 14 + 6 + 3  # data, optimizer, step


def test_component_configs_derive_their_other_fields_from_the_flags() -> None:
    from utils.training.data import DataConfig
    from utils.training.step import StepConfig

    components = _built_components(NON_DEFAULT_ARGV)
    step = components[StepConfig]
    assert (step.precision, step.class_weights) == ("bf16", (1.0, 2.0, 3.0))  # resolved by the caller
    assert step.freeze_encoder_before_epoch == 4 - 1 + 2  # --start_from 4 --freeze-encoder-epochs 2
    defaults = _built_components([])
    assert defaults[StepConfig].freeze_encoder_before_epoch == 0
    assert defaults[DataConfig].ignore_values == ()
