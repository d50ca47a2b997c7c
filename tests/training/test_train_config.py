"""train.py flags (utils.training.config): parsing, defaults and validation messages."""

from __future__ import annotations

import dataclasses

import pytest

from utils.errors import ConfigError
from utils.training.config import TrainConfig, parse_config


def test_documented_flags_and_short_forms() -> None:
    config = parse_config(
        ["-e", "7", "-b", "3", "-l", "2e-4", "-f", "w.pth", "-s", "0.25", "-v", "20", "-c", "3", "--amp",
         "--bilinear", "--exp_name", "run1", "--save_every", "2", "--start_from", "4"]
    )  # fmt: skip
    assert (
        config.optimisation.epochs,
        config.optimisation.batch_size,
        config.optimisation.learning_rate,
        config.checkpoint.load,
    ) == (7, 3, 2e-4, "w.pth")
    assert (config.data.scale, config.data.validation, config.model.classes) == (0.25, 20.0, 3)
    assert config.performance.amp and config.model.bilinear
    assert (config.checkpoint.exp_name, config.checkpoint.save_every, config.checkpoint.start_from) == ("run1", 2, 4)
    # Underscored flags of the documented DDP script also accept dashes.
    assert parse_config(["--exp-name", "x", "--save-every", "3"]).checkpoint.save_every == 3


def test_defaults_are_milesials_flags_with_this_projects_optimizer_and_schedule() -> None:
    config = parse_config([])
    # milesial/Pytorch-UNet's train.py defaults:
    assert (
        config.optimisation.epochs,
        config.optimisation.batch_size,
        config.optimisation.learning_rate,
        config.data.scale,
    ) == (5, 1, 1e-5, 0.5)
    assert (config.data.validation, config.model.classes) == (10.0, 2)
    # This project's own: AdamW with a cosine schedule (milesial's RMSprop + ReduceLROnPlateau is
    # --optimizer rmsprop --scheduler plateau).
    assert (config.optimisation.optimizer, config.optimisation.scheduler) == ("adamw", "cosine")
    assert (
        config.logging.wandb == "disabled" and config.checkpoint.resume is None and config.optimisation.grad_clip == 1.0
    )


def test_resume_without_value_means_auto() -> None:
    assert parse_config(["--resume"]).checkpoint.resume == "auto"
    assert parse_config(["--resume", "ck/last.pth"]).checkpoint.resume == "ck/last.pth"


@pytest.mark.parametrize("flag", ["--local-rank=1", "--local_rank=1"])
def test_legacy_launcher_local_rank_argument(flag: str) -> None:
    # torch.distributed.launch appends --local-rank (older versions --local_rank) unless --use-env.
    assert parse_config(["--ddp_mode", flag]).launch.local_rank == 1


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
        (["--dist-timeout", "inf"], r"--dist-timeout must be a finite number in \(0, 604800\], got inf"),
        (["--dist-timeout", "0"], "--dist-timeout must be a finite number"),
        (["--scale", "nan"], "--scale must be a finite number in"),
        (["-v", "inf"], "--validation must be a finite number in"),
        (["--seed", "-1"], r"--seed must be in \[0, 4294967295\], got -1"),
        (["--seed", "4294967296"], r"--seed must be in \[0, 4294967295\], got 4294967296"),
        (["--local-rank", "-1"], "--local-rank must be at least 0, got -1"),
    ],
)
def test_invalid_flags_name_the_flag(argv: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_config(argv)


@pytest.mark.parametrize("rank", ["2", "-1"])
def test_a_manual_rank_outside_the_world_size_is_refused_by_the_launch_plan(rank: str) -> None:
    from utils.launch.environments import plan_launch

    # Checked once, where every launcher's rank is checked (plan_launch), not again at parse time.
    config = parse_config(["--rank", rank, "--world-size", "2", "--dist-url", "tcp://h:1"])
    with pytest.raises(ConfigError, match=rf"--rank={rank} is outside 0\.\.1 \(--world-size=2\)"):
        plan_launch(config.launch, environ={})


def test_epochs_count_from_start_from_as_the_ddp_script() -> None:
    # --start_from 9 --epochs 5 trains epochs 9..13 (it used to be refused: --epochs was the last epoch's number).
    config = parse_config(["--start_from", "9", "-e", "5"])
    assert (config.checkpoint.start_from, config.optimisation.epochs) == (9, 5)
    assert parse_config(["--start_from", "2", "-e", "1"]).optimisation.epochs == 1


def test_largest_accepted_values() -> None:
    config = parse_config(["-l", "1", "--weight-decay", "1", "--momentum", "0.99", "--seed", str(2**32 - 1)])
    assert (config.optimisation.learning_rate, config.optimisation.weight_decay, config.data.seed) == (
        1.0,
        1.0,
        2**32 - 1,
    )
    assert parse_config(["--dist-timeout", "604800", "--grad-clip", "0"]).launch.dist_timeout == 604800


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
    from utils.training.config import build_parser

    text = build_parser().format_help()
    help_groups = ("data", "model", "optimisation", "distributed", "checkpoints", "logging", "performance")
    positions = [text.index(f"\n{group}:\n") for group in help_groups]
    assert positions == sorted(positions)
    # Each flag is listed under its group: the text between a group's title and the next one's.
    ends = [*positions[1:], len(text)]
    sections = {group: text[start:end] for group, start, end in zip(help_groups, positions, ends, strict=True)}
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


# Every flag away from its default, valid together (a resnet encoder for --freeze-encoder-epochs).
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


def test_each_flag_sits_in_the_section_of_its_help_group_and_as_dict_is_the_flat_record() -> None:
    from utils.flags import flag_fields

    config = parse_config(NON_DEFAULT_ARGV)
    items = list(flag_fields(TrainConfig))
    titles = {"launch": "distributed", "checkpoint": "checkpoints"}
    for field in dataclasses.fields(TrainConfig):
        in_section = {item.dest for item in flag_fields(type(getattr(config, field.name)))}
        assert {item.title for item in items if item.dest in in_section} == {titles.get(field.name, field.name)}
    assert (config.optimisation.batch_size, config.data.seed, config.launch.val_mode) == (3, 7, "sharded")
    # Checkpoints store one flat dict keyed by field name (old checkpoints and config.yaml files are read by it).
    flat = config.as_dict()
    assert list(flat) == [item.dest for item in items] and len(flat) == len({item.dest for item in items})
    assert flat["batch_size"] == 3 and flat["ignore_values"] == [255, 254]
    assert TrainConfig.from_dict(flat) == config
    # A record from before a flag existed (or with a key that is no flag any more) takes the defaults.
    assert TrainConfig.from_dict({"epochs": 9, "gone": 1}) == dataclasses.replace(
        TrainConfig(), optimisation=dataclasses.replace(TrainConfig().optimisation, epochs=9)
    )


def test_help_texts_are_the_field_docstrings() -> None:
    from utils.training.config import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "--batch-size BATCH_SIZE, -b BATCH_SIZE Batch size per process (default: 1)" in text
    assert "--seed SEED Seed of initialisation, data order and augmentation (0..4294967295) (default: 0)" in text


def test_the_step_freezes_the_encoder_for_the_epochs_counted_from_start_from() -> None:
    from tests.helpers import CPU_CONTEXT
    from unet import UNet
    from utils.training.step import TrainStep

    model = UNet(3, 2, base_channels=8)

    def step(argv: list[str]) -> TrainStep:
        return TrainStep(parse_config(argv), model, CPU_CONTEXT, precision="bf16", total_steps=10, class_weights=None)

    resnet = ["--encoder", "resnet18"]
    assert step([*resnet, "--freeze-encoder-epochs", "2", "--start_from", "4"]).freeze_encoder_before_epoch == 4 - 1 + 2
    assert step([]).freeze_encoder_before_epoch == 0 and step([]).precision == "bf16"


def test_a_resume_applies_every_flags_rule(caplog: pytest.LogCaptureFixture) -> None:
    """The table walked: each flag in turn recorded with another value than this command's, through the resume's check
    (must match: refused naming the flag and --load; may change: said in one line, old -> new; new plan: silent)."""
    import types

    from utils.flags import MAY_CHANGE, MUST_MATCH, NEW_PLAN, flag_fields
    from utils.training.setup import check_resume_flags

    config = parse_config([])
    for item in flag_fields(TrainConfig):
        flag, rule = item.flag.name, item.flag.resume
        recorded = 7 if item.dest in ("epochs", "start_from") else "recorded"  # the epoch plan is read as numbers
        state = types.SimpleNamespace(run_args={**config.as_dict(), item.dest: recorded})
        caplog.clear()
        if rule == MUST_MATCH:
            with pytest.raises(ConfigError, match=rf"with {flag} recorded but this run asks for .*--load last\.pth"):
                check_resume_flags(config, state, "last.pth")  # type: ignore[arg-type]
            continue
        with caplog.at_level("INFO", logger="utils.training.setup"):
            resumed = check_resume_flags(config, state, "last.pth")  # type: ignore[arg-type]
        said = [r.getMessage() for r in caplog.records if "The resumed run changes" in r.getMessage()]
        if rule == MAY_CHANGE:
            line = f"The resumed run changes 1 flag: {flag} recorded -> "
            assert len(said) == 1 and said[0].startswith(line), (flag, said)
            assert resumed.as_dict()[item.dest] == config.as_dict()[item.dest], f"{flag} takes this command's value"
        else:
            assert rule == NEW_PLAN and said == [], f"{flag}: resume={rule!r}, said {said}"


def test_reliability_md_lists_the_must_match_flags_of_the_table() -> None:
    import re

    from tests.conftest import REPO_ROOT
    from utils.flags import MUST_MATCH, flag_fields

    text = (REPO_ROOT / "docs" / "RELIABILITY.md").read_text()
    bullet = text[text.index("- **must match**") : text.index("- **may change**")]
    listed = set(re.findall(r"`(--[a-z_-]+)", bullet)) - {"--load"}  # --load FILE: the way out, named in the bullet
    assert listed == {item.flag.name for item in flag_fields(TrainConfig) if item.flag.resume == MUST_MATCH}


def test_the_resume_rules_of_the_objective_averages_and_plan() -> None:
    from utils.flags import MAY_CHANGE, MUST_MATCH, NEW_PLAN, flag_fields

    rule = {item.flag.name: item.flag.resume for item in flag_fields(TrainConfig)}
    must = ["--optimizer", "--scheduler", "--learning-rate", "--weight-decay", "--momentum", "--warmup-steps",
            "--class-weights", "--scale", "--validation", "--seed", "--ignore-value", "--oversample-foreground",
            "--augment", "--ema", "--split-by", "--folds", "--fold", "--base-channels"]  # fmt: skip
    assert {flag: rule[flag] for flag in must} == dict.fromkeys(must, MUST_MATCH)
    may = ["--patience", "--min-delta", "--batch-size", "--max-steps", "--tensorboard", "--keep-best"]
    assert {flag: rule[flag] for flag in may} == dict.fromkeys(may, MAY_CHANGE)
    assert {rule[flag] for flag in ("--epochs", "--start_from", "--load", "--resume")} == {NEW_PLAN}


def test_a_resume_keeps_the_checkpoints_epoch_plan_for_every_component(caplog: pytest.LogCaptureFixture) -> None:
    import types

    from tests.helpers import CPU_CONTEXT
    from unet import UNet
    from utils.training.setup import check_resume_flags
    from utils.training.step import TrainStep

    freeze = ["--encoder", "resnet18", "--freeze-encoder-epochs", "2"]
    asked = parse_config(["--start_from", "1", "--epochs", "2", *freeze])
    state = types.SimpleNamespace(run_args={**asked.as_dict(), "start_from": 4, "epochs": 3})
    with caplog.at_level("WARNING"):
        planned = check_resume_flags(asked, state, "last.pth")  # type: ignore[arg-type]
    assert planned.epoch_range() == (4, 6) and planned.model == asked.model
    assert "--resume continues the run's plan, epochs 4..6 (--start_from 4 --epochs 3)" in caplog.text
    same_plan = types.SimpleNamespace(run_args=asked.as_dict())
    assert check_resume_flags(asked, same_plan, "last.pth") == asked  # type: ignore[arg-type]
    unrecorded = types.SimpleNamespace(run_args={})  # a checkpoint that records no flags is not checked
    assert check_resume_flags(asked, unrecorded, "last.pth") is asked  # type: ignore[arg-type]
    # The frozen epochs count from the plan's --start_from, not from the one this command gave (and which it ignores).
    step = TrainStep(
        planned, UNet(3, 2, base_channels=8), CPU_CONTEXT, precision="fp32", total_steps=6, class_weights=None
    )
    assert step.freeze_encoder_before_epoch == 4 - 1 + 2
