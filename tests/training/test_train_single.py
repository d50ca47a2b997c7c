"""One-process training through ``train.main``: run outputs, exact resume, --load formats, bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.conftest import REPO_ROOT, SyntheticData, TrainRunner, assert_same_training_state, child_env, load_checkpoint
from tests.helpers import cpu_has_bf16_instructions, read_metrics, save_checkpoint, tiny_unet
from unet import UNet

TRAIN_KEYS = {"event", "epoch", "global_step", "loss", "lr", "images_per_s", "images_seen", "time"}
VAL_KEYS = {"event", "epoch", "global_step", "dice", "iou", "per_class_dice", "per_class_iou", "time"}


@pytest.fixture(scope="module")
def multiclass_data(tmp_path_factory: pytest.TempPathFactory) -> SyntheticData:
    from utils.datasets.synthetic import generate_carvana_like

    root = tmp_path_factory.mktemp("multiclass")
    generate_carvana_like(root, 8, size=(48, 32), n_classes=3, seed=1)
    return SyntheticData(root / "imgs", root / "masks", 8)


def test_run_outputs_and_bit_exact_resume(runner: TrainRunner) -> None:
    """2 epochs straight == resumed after epoch 1 == stopped mid-epoch (--max-steps) and resumed with --resume auto."""
    # 16 images, 10 % validation: 15 training images, batch 2: 8 steps per epoch.
    assert runner.main("straight", "-e", "2", "--log-every", "2") == 0
    straight = runner.run_dir("straight")
    names = sorted(p.name for p in straight.iterdir())
    assert names == [
        ".lock", "best.pth", "checkpoint_epoch1.pth", "checkpoint_epoch2.pth", "config.yaml", "curves.png",
        "last.pth", "metrics.jsonl", "split.json",
    ]  # fmt: skip
    last = load_checkpoint(straight / "last.pth")
    assert (last["epoch"], last["global_step"], last["step_in_epoch"], last["world_size"]) == (2, 16, 0, 1)
    assert last["model_args"] == {"n_channels": 3, "n_classes": 2, "bilinear": False, "base_channels": 8}
    assert last["mask_values"] == [0, 1] and last["args"]["exp_name"] == "straight"
    events = read_metrics(straight)
    train_events = [e for e in events if e["event"] == "train"]
    val_events = [e for e in events if e["event"] == "val"]
    assert [e["global_step"] for e in train_events] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert all(TRAIN_KEYS <= e.keys() for e in train_events) and train_events[-1]["images_seen"] == 30
    assert [(e["epoch"], e["global_step"]) for e in val_events] == [(1, 8), (2, 16)]
    assert all(VAL_KEYS <= e.keys() and len(e["per_class_dice"]) == 2 for e in val_events)
    assert last["best_dice"] == max(e["dice"] for e in val_events)
    with Image.open(straight / "curves.png") as curves:
        assert curves.format == "PNG" and curves.size[0] > curves.size[1]

    # Resume the state saved after epoch 1, in another run folder.
    epoch1 = str(straight / "checkpoint_epoch1.pth")
    assert runner.main("from_epoch1", "-e", "2", "--resume", epoch1) == 0
    assert_same_training_state(straight / "last.pth", runner.run_dir("from_epoch1") / "last.pth")

    # --resume auto in an empty folder starts a new run (a requeued job's first start); it stops mid-epoch at step 3
    # and the second --resume auto continues it; --keep-last 1 leaves one epoch file.
    assert runner.main("midway", "-e", "2", "--max-steps", "3", "--keep-last", "1", "--resume") == 0
    midway = load_checkpoint(runner.run_dir("midway") / "last.pth")
    assert (midway["epoch"], midway["global_step"], midway["step_in_epoch"]) == (0, 3, 3)
    assert runner.main("midway", "-e", "2", "--keep-last", "1", "--resume") == 0
    assert_same_training_state(straight / "last.pth", runner.run_dir("midway") / "last.pth")
    assert not (runner.run_dir("midway") / "checkpoint_epoch1.pth").exists()
    assert (runner.run_dir("midway") / "checkpoint_epoch2.pth").exists()


def test_features_multiclass_rmsprop_plateau_accumulation(
    multiclass_data: SyntheticData, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runner = TrainRunner(multiclass_data, tmp_path)
    code = runner.main(
        "features", "-c", "3", "-v", "40", "-e", "2", "--optimizer", "rmsprop", "--scheduler", "plateau",
        "--grad-accum", "2", "--augment", "--channels-last", "--checkpointing", "--precision", "bf16",
        "--save_every", "2", "--save-every-steps", "1", "--log-every", "1", "--num-workers", "1",
    )  # fmt: skip
    assert code == 0
    run_dir = runner.run_dir("features")
    last = load_checkpoint(run_dir / "last.pth")
    # 5 training images, batch 2: 3 micro-batches per epoch, accumulated in groups of 2 -> 2 optimizer steps.
    assert last["global_step"] == 4
    assert "best" in last["scheduler"] and last["scheduler"]["last_epoch"] == 2  # plateau stepped once per validation
    assert sorted(p.name for p in run_dir.glob("checkpoint_epoch*.pth")) == ["checkpoint_epoch2.pth"]
    assert "Saved last.pth at step 1 (0 epochs and 2 batches done)" in caplog.text  # --save-every-steps
    val_events = read_metrics(run_dir, event="val")
    # 3 validation images with batch 2: the last, partial batch counts too.
    assert len(val_events) == 2 and val_events[0]["n_images"] == 3 and len(val_events[0]["per_class_dice"]) == 3


def _weights_file(tmp_path: Path, kind: str, *, n_channels: int = 3, n_classes: int = 2) -> tuple[Path, dict]:
    """``kind``: "ours", "milesial" (with mask_values) or "ddp" (``module.`` prefixes, no mask_values)."""
    model = tiny_unet(123, n_channels=n_channels, n_classes=n_classes)
    mask_values = None if kind == "ddp" else list(range(max(n_classes, 2)))
    path = save_checkpoint(tmp_path / f"{kind}.pth", model, mask_values, style=kind)
    return path, model.state_dict()


@pytest.mark.parametrize("kind", ["milesial", "ddp", "ours"])
def test_load_weights_in_every_accepted_format(runner: TrainRunner, tmp_path: Path, kind: str) -> None:
    path, loaded = _weights_file(tmp_path, kind)
    # --start_from 2 -e 1: one epoch, numbered 2 (as the documented script numbers epochs).
    assert runner.main(kind, "--load", str(path), "--start_from", "2", "-e", "1", "-l", "1e-5") == 0
    run_dir = runner.run_dir(kind)
    assert sorted(p.name for p in run_dir.glob("checkpoint_epoch*.pth")) == ["checkpoint_epoch2.pth"]
    saved = load_checkpoint(run_dir / "last.pth")
    assert (saved["epoch"], saved["global_step"]) == (2, 8)  # fresh optimizer: steps count from 0
    assert {e["epoch"] for e in read_metrics(run_dir) if e["event"] in ("train", "val")} == {2}
    # Eight small steps from the loaded weights, far from the run's own initialisation.
    torch.manual_seed(0)
    fresh = UNet(3, 2, base_channels=8).state_dict()
    key = "inc.double_conv.0.weight"
    assert (saved["model_state"][key] - loaded[key]).abs().max() < 1e-3
    assert (fresh[key] - loaded[key]).abs().max() > 1e-2


def _bad_weights(tmp_path: Path, which: str) -> Path:
    if which == "classes":
        return _weights_file(tmp_path, "milesial", n_classes=3)[0]
    if which == "channels":
        return _weights_file(tmp_path, "ours", n_channels=1)[0]
    path = tmp_path / "notes.pth"
    path.write_text("these are not weights")
    return path


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["-v", "1"], "--validation 1 leaves 16 training and 0 validation images"),
        (["-b", "64"], "--batch-size 64 is larger than the 15 training images"),
        (["--scale", "0"], "--scale must be a finite number in (0, 1]"),
        (["--load", "BAD:classes"], "trained with n_classes=3 but --classes asks for 2; pass --classes 3"),
        (["--load", "BAD:channels"], "expects 1-channel images but the images in --imgs have 3 channels"),
        (["--load", "BAD:text"], "notes.pth is corrupt"),
        (["--ddp_mode"], "torchrun --nproc_per_node=NUM_GPUS train.py"),
        (["--precision", "fp16"], "--precision fp16 needs a CUDA device"),
        (
            ["--resume", "missing.pth"],
            "checkpoint missing.pth does not exist; check the path given to --load/--model/--resume",
        ),
    ],
)
def test_bad_input_is_one_clear_line(
    runner: TrainRunner, tmp_path: Path, capsys: pytest.CaptureFixture, extra: list[str], match: str
) -> None:
    extra = [str(_bad_weights(tmp_path, arg[4:])) if arg.startswith("BAD:") else arg for arg in extra]
    assert runner.main("bad", "-e", "1", *extra) == 2
    error_lines = capsys.readouterr().err.strip().splitlines()
    assert len(error_lines) == 1 and error_lines[0].startswith("Error: ")
    assert match in error_lines[0]
    assert not (runner.run_dir("bad") / "last.pth").exists()


def test_no_data(runner: TrainRunner, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "empty").mkdir()
    argv = runner.args("nodata") + ["--imgs", str(tmp_path / "empty"), "--masks", str(tmp_path / "empty")]
    import train

    assert train.main(argv) == 2
    assert "Error: no images in" in capsys.readouterr().err


def test_a_rerun_begins_a_new_numbered_folder_and_overwrites_nothing(
    runner: TrainRunner, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = runner.run_dir("taken")
    run_dir.mkdir(parents=True)
    (run_dir / "last.pth").write_bytes(b"precious")
    assert runner.main("taken", "-e", "1", "--max-steps", "1") == 0
    assert f"this run writes to {runner.run_dir('taken-2')}" in caplog.text
    assert (run_dir / "last.pth").read_bytes() == b"precious"
    assert (runner.run_dir("taken-2") / "last.pth").is_file()
    assert runner.main("taken", "-e", "1", "--max-steps", "1") == 0
    assert (runner.run_dir("taken-3") / "last.pth").is_file()
    # --resume auto continues the newest of them.
    caplog.clear()
    assert runner.main("taken", "-e", "1", "--max-steps", "2", "--resume", "auto") == 0
    assert f"Resuming from {runner.run_dir('taken-3') / 'last.pth'}" in caplog.text
    assert not runner.run_dir("taken-4").exists()


def test_cuda_out_of_memory_is_one_line_naming_the_fixes(
    runner: TrainRunner, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import train

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(train, "build_trainer", out_of_memory)
    assert runner.main("oom", "-e", "1") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("Error: CUDA ran out of memory")
    assert "--batch-size" in err and "--scale" in err and "--amp" in err and "--checkpointing" in err


def test_bad_input_exit_status_and_stderr_of_the_real_script(runner: TrainRunner, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    result = subprocess.run(
        [sys.executable, "train.py", *runner.args("cli"), "--imgs", str(empty), "--masks", str(empty)],
        cwd=REPO_ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith(f"Error: no images in {empty}")


def test_amp_on_a_cpu_without_native_bf16_warns(runner: TrainRunner, capsys: pytest.CaptureFixture) -> None:
    # The oracle is the kernel's list of CPU flags, not the probe the code uses.
    native = cpu_has_bf16_instructions()
    assert runner.main("amp", "--amp", "--epochs", "1", "--max-steps", "1") == 0
    warned = "bf16 on this CPU is emulated" in capsys.readouterr().out
    assert warned == (not native)
