"""Resume decides explicitly: a flag that would be logged but not used, or that changes the data, is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import SyntheticData, TrainRunner, load_checkpoint
from tests.helpers import one_error_line

TRAINED = ["-e", "2", "--max-steps", "2", "-l", "1e-5", "-v", "25"]


@pytest.mark.parametrize(
    ("change", "flag"),
    [
        (["-l", "1e-3"], "--learning-rate 1e-05 but this run asks for --learning-rate 0.001"),
        (["-v", "50"], "--validation 25.0 but this run asks for --validation 50.0"),
        (["--seed", "1"], "--seed 0 but this run asks for --seed 1"),
        (["--scale", "0.5"], "--scale 1.0 but this run asks for --scale 0.5"),
        (["--weight-decay", "0.1"], "--weight-decay"),
    ],
)
def test_resume_refuses_a_changed_flag_and_names_the_way_out(
    runner: TrainRunner, capsys: pytest.CaptureFixture, change: list[str], flag: str
) -> None:
    assert runner.main("flags", *TRAINED) == 0
    last = runner.run_dir("flags") / "last.pth"
    before = last.read_bytes()
    capsys.readouterr()
    assert runner.main("flags", *TRAINED, *change, "--resume", "auto") == 2
    error = one_error_line(capsys.readouterr().err)
    assert flag in error and f"--load {last}" in error, error
    assert last.read_bytes() == before
    # The way out: a new run (the next folder of the series) from those weights.
    assert runner.main("flags", "-e", "1", "--max-steps", "1", "-v", "25", *change, "--load", str(last)) == 0
    assert load_checkpoint(runner.run_dir("flags-2") / "last.pth")["global_step"] == 1


def test_resume_refuses_another_dataset(runner: TrainRunner, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert runner.main("data", *TRAINED) == 0
    fewer = SyntheticData(tmp_path / "imgs", tmp_path / "masks", runner.data.n_images - 1)
    shutil.copytree(runner.data.imgs, fewer.imgs)
    shutil.copytree(runner.data.masks, fewer.masks)
    dropped = sorted(fewer.imgs.iterdir())[0]
    dropped.unlink()
    next(fewer.masks.glob(f"{dropped.stem}*")).unlink()
    other = TrainRunner(fewer, runner.checkpoint_dir)
    capsys.readouterr()
    assert other.main("data", *TRAINED, "--resume", "auto") == 2
    error = one_error_line(capsys.readouterr().err)
    assert "was trained on another dataset (16 images, now 15" in error and "--load" in error, error


# Every flag that changes what the loss measures, changed either way (unset -> set included: a check of "saved is not
# None" let a resume add --class-weights to a run trained without them).
OBJECTIVE_CHANGES = [
    ([], ["--class-weights", "auto"], "trained with no --class-weights but this run asks for --class-weights auto"),
    (["--class-weights", "auto"], [], "trained with --class-weights auto but this run asks for no --class-weights"),
    (["--class-weights", "1,2"], ["--class-weights", "1,3"], "--class-weights 1,2 but this run asks for"),
    ([], ["--ignore-value", "7"], "trained with no --ignore-value but this run asks for --ignore-value 7"),
    (["--ignore-value", "7"], [], "trained with --ignore-value 7 but this run asks for no --ignore-value"),
    ([], ["--oversample-foreground", "0.5"], "--oversample-foreground 0.0 but this run asks for"),
    (["--oversample-foreground", "0.5"], [], "--oversample-foreground 0.5 but this run asks for"),
    ([], ["--augment"], "trained with no --augment but this run asks for --augment"),
    (["--augment"], [], "trained with --augment but this run asks for no --augment"),
]


@pytest.mark.parametrize(("trained", "resumed", "expected"), OBJECTIVE_CHANGES)
def test_resume_refuses_an_objective_flag_set_unset_or_changed(
    runner: TrainRunner, capsys: pytest.CaptureFixture, trained: list[str], resumed: list[str], expected: str
) -> None:
    assert runner.main("objective", *TRAINED, *trained) == 0
    last = runner.run_dir("objective") / "last.pth"
    before = last.read_bytes()
    capsys.readouterr()
    assert runner.main("objective", *TRAINED, *resumed, "--resume", "auto") == 2
    error = one_error_line(capsys.readouterr().err)
    assert expected in error and f"--load {last}" in error, error
    assert last.read_bytes() == before
    # The control: the same flags again resume (nothing else in the command trips the check).
    assert runner.main("objective", "-e", "3", *TRAINED[2:], *trained, "--resume", "auto") == 0


def test_resume_says_a_changed_may_change_flag_and_refuses_a_changed_ema(
    runner: TrainRunner, capsys: pytest.CaptureFixture
) -> None:
    """The resume rules end to end: --patience may change (one line, old -> new), --ema's decay must match."""
    averaged = [*TRAINED, "--ema", "0.9", "--patience", "3"]
    assert runner.main("rules", *averaged) == 0
    last = runner.run_dir("rules") / "last.pth"
    before = last.read_bytes()
    capsys.readouterr()
    assert runner.main("rules", *TRAINED, "--ema", "0.5", "--patience", "3", "--resume", "auto") == 2
    error = one_error_line(capsys.readouterr().err)
    assert "--ema 0.9 but this run asks for --ema 0.5" in error and f"--load {last}" in error, error
    assert last.read_bytes() == before
    assert runner.main("rules", "-e", "3", *TRAINED[2:], "--ema", "0.9", "--resume", "auto") == 0
    out = capsys.readouterr().out
    changed = [line for line in out.splitlines() if "The resumed run changes" in line]
    assert len(changed) == 1 and changed[0].endswith("changes 1 flag: --patience 3 -> --patience 0"), changed
