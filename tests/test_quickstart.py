"""scripts/quickstart.sh reruns: more epochs continue from the last weights, other images train a new model.

The plan (``scripts/quickstart_plan.py``) is tested case by case on real training runs in this process; the script
itself runs end to end at a tiny size (its environment settings), then reruns with more epochs.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from scripts.quickstart_plan import main as quickstart_plan_main
from scripts.quickstart_plan import plan_quickstart
from scripts.quickstart_samples import overlay_samples
from tests.conftest import REPO_ROOT, TrainRunner, child_env
from tests.helpers import one_error_line
from utils.checkpoint.files import load_checkpoint_file
from utils.checkpoint.format import TrainingState
from utils.errors import USER_ERROR_EXIT_CODE


def epochs_done(checkpoint: Path) -> int:
    return TrainingState.of(load_checkpoint_file(checkpoint), checkpoint).position.epoch


def test_a_first_quickstart_starts_a_run_that_a_rerun_would_resume(runner: TrainRunner, carvana_data):
    plan = plan_quickstart(runner.checkpoint_dir, "demo", carvana_data.imgs, 3)
    assert plan.folder.path == runner.run_dir("demo") and plan.message == ""
    assert plan.train_flags == ("--exp_name", "demo", "--epochs", "3", "--resume", "auto")


def test_more_epochs_continue_from_the_last_weights_in_a_new_folder(runner: TrainRunner, carvana_data):
    assert runner.main("demo", "--epochs", "1") == 0
    first = runner.run_dir("demo") / "last.pth"

    same = plan_quickstart(runner.checkpoint_dir, "demo", carvana_data.imgs, 1)
    assert same.train_flags == () and same.folder.path == runner.run_dir("demo")
    assert (
        same.message
        == f"{runner.run_dir('demo')} holds a model trained for 1 epoch: nothing to train (set DEMO_EPOCHS above 1)"
    )

    more = plan_quickstart(runner.checkpoint_dir, "demo", carvana_data.imgs, 2)
    assert more.folder.path == runner.run_dir("demo-2")
    # The newest state of the folder: last.pth or a copy of it (checkpoint_epoch1.pth, best.pth).
    loaded = Path(more.train_flags[more.train_flags.index("--load") + 1])
    assert loaded.parent == runner.run_dir("demo") and epochs_done(loaded) == 1
    assert more.message == (
        f"Training on to epoch 2: a new run in {runner.run_dir('demo-2')} starts from the weights of {loaded} "
        f"(epoch 1) with --load and trains epochs 2..2"
    )
    assert runner.main("demo", *more.train_flags) == 0  # the flags as the script passes them
    assert epochs_done(more.folder.last) == 2 and epochs_done(first) == 1  # the first run is kept as it was
    assert not runner.run_dir("demo-3").exists()
    # The next rerun reads the new folder: already at 2 epochs.
    assert plan_quickstart(runner.checkpoint_dir, "demo", carvana_data.imgs, 2).train_flags == ()


def test_a_stopped_run_is_resumed(runner: TrainRunner, carvana_data):
    assert runner.main("demo", "--epochs", "2", "--save-every-steps", "1", "--max-steps", "9") == 0
    assert epochs_done(runner.run_dir("demo") / "last.pth") == 1
    plan = plan_quickstart(runner.checkpoint_dir, "demo", carvana_data.imgs, 2)
    assert plan.train_flags[-2:] == ("--resume", "auto") and plan.folder.path == runner.run_dir("demo")
    assert plan.message.startswith(f"Continuing the stopped run in {runner.run_dir('demo')} (epoch 1 of 2 done)")


def test_other_images_train_a_new_model_in_a_new_folder(runner: TrainRunner, carvana_data, tmp_path):
    assert runner.main("demo", "--epochs", "1") == 0
    own = tmp_path / "own"
    shutil.copytree(carvana_data.imgs, own)
    next(own.iterdir()).unlink()  # other images: here, one fewer
    plan = plan_quickstart(runner.checkpoint_dir, "demo", own, 1)
    assert plan.folder.path == runner.run_dir("demo-2")
    assert plan.message.startswith(f"{own} holds other images than {runner.run_dir('demo')} was trained on")
    assert plan.train_flags == ("--exp_name", "demo", "--epochs", "1")  # from scratch, no --resume, no --load


def test_a_folder_of_damaged_checkpoints_is_one_error_line(tmp_path, carvana_data, capsys):
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "last.pth").write_bytes(b"not a checkpoint")
    argv = ["--checkpoint-dir", str(tmp_path), "--exp-name", "demo", "--imgs", str(carvana_data.imgs), "--epochs", "2"]
    assert quickstart_plan_main(argv) == USER_ERROR_EXIT_CODE
    assert f"no usable checkpoint in run folder {tmp_path / 'demo'}" in one_error_line(capsys.readouterr().err)


def test_overlay_samples_show_different_cars_first(tmp_path):
    for car in ("aaa", "bbb", "ccc"):
        for view in range(1, 5):
            (tmp_path / f"{car}_{view:02d}.jpg").write_bytes(b"")
    (tmp_path / ".hidden.jpg").write_bytes(b"")
    names = [path.name for path in overlay_samples(tmp_path, 8)]
    assert names == ["aaa_01.jpg", "bbb_01.jpg", "ccc_01.jpg", "aaa_02.jpg", "bbb_02.jpg", "ccc_02.jpg",
                     "aaa_03.jpg", "bbb_03.jpg"]  # fmt: skip
    assert len(overlay_samples(tmp_path, 20)) == 12


# At this size each run of the script takes about a minute on two busy cores, most of it interpreter start-ups.
TINY = {
    "QUICKSTART_SETUP": "0",
    "DEMO_IMAGES": "12",
    "DEMO_VIEWS": "1",  # 12 cars: --split-by prefix can validate on 10 % of them
    "DEMO_TEST_IMAGES": "2",
    "DEMO_SIZE": "64x48",
    "DEMO_BASE_CHANNELS": "8",
    "DEMO_BATCH_SIZE": "2",
}


def quickstart(root: Path, epochs: int) -> str:
    env = child_env({**TINY, "QUICKSTART_ROOT": str(root), "DEMO_EPOCHS": str(epochs), "OMP_NUM_THREADS": "1"})
    result = subprocess.run(
        ["bash", "scripts/quickstart.sh"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
def test_the_script_reruns_with_more_epochs(tmp_path):
    # The other rerun, the user's own images, is the plan's case above (a first run's flags, in a new folder); the
    # script passes the plan's flags the same way in every case, so one rerun through it shows the wiring.
    out = quickstart(tmp_path, 1)
    checkpoints = tmp_path / "checkpoints"
    # It trains as it advises: views of one car on one side of the split, so no warning that recommends it.
    assert "split_by: prefix\n" in (checkpoints / "demo" / "config.yaml").read_text()
    assert "use --split-by prefix" not in out
    assert epochs_done(checkpoints / "demo" / "last.pth") == 1

    out = quickstart(tmp_path, 2)
    assert f"Training on to epoch 2: a new run in {checkpoints / 'demo-2'}" in out
    assert epochs_done(checkpoints / "demo-2" / "last.pth") == 2
    assert f"Checkpoints, metrics.jsonl, curves.png:          {checkpoints / 'demo-2'}/" in out
    assert (tmp_path / "outputs" / "demo-2" / "test_evaluation.json").is_file()
