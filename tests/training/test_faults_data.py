"""Bad data found mid-run loses nothing: the run saves INTERRUPTED.pth, then stops with one line naming the file.

The policy (docs/RELIABILITY.md, "What survives a crash"): stop, not skip. A truncated JPEG passes the start-up scan
(it reads headers only) and fails when its pixels are decoded, in training or in validation.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import SyntheticData, TrainRunner, finish, load_checkpoint, torchrun_prefix
from tests.helpers import names_rank_0_with_status_2, one_error_line, torchrun_root_cause
from utils.datasets.dataset import BasicDataset
from utils.errors import DatasetError
from utils.training.config import parse_config
from utils.training.data import build_data
from utils.training.sampler import ResumableDistributedSampler

ARGS = ["-v", "25", "-e", "2"]


def _copy_with_a_truncated_image(
    data: SyntheticData, root: Path, split: str, *, trained_by_rank_of_two: int | None = None
) -> tuple[SyntheticData, Path]:
    """A copy of ``data`` with one image of ``split`` truncated; ``trained_by_rank_of_two``: in training, one that
    the first epoch of a 2-process run (default seed) gives to that rank, as its last batch."""
    copy = SyntheticData(root / "imgs", root / "masks", data.n_images)
    shutil.copytree(data.imgs, copy.imgs)
    shutil.copytree(data.masks, copy.masks)
    settings = parse_config(["--imgs", str(copy.imgs), "--masks", str(copy.masks), "-s", "1", "-v", "25"])
    built = build_data(settings)
    subset = built.val_set if split == "validation" else built.train_set
    position = -1  # not the first training item: set-up loads that one to time the loaders
    if trained_by_rank_of_two is not None:
        shard = ResumableDistributedSampler(len(subset), rank=trained_by_rank_of_two, world_size=2, seed=0)
        shard.set_epoch(0)
        position = list(shard)[-1]
    image_id = built.train_dataset.ids[subset.indices[position]]
    victim = next(copy.imgs.glob(f"{image_id}.*"))
    assert victim.suffix == ".jpg"
    content = victim.read_bytes()
    # Headers intact (the scan reads them), the compressed pixels cut short just after the start of scan marker.
    victim.write_bytes(content[: content.index(b"\xff\xda") + 40])
    return copy, victim


@pytest.mark.parametrize(("split", "workers"), [("training", "0"), ("training", "1"), ("validation", "0")])
def test_a_truncated_jpeg_mid_run_saves_interrupted_and_is_one_line(
    runner: TrainRunner, tmp_path: Path, capsys: pytest.CaptureFixture, split: str, workers: str
) -> None:
    data, victim = _copy_with_a_truncated_image(runner.data, tmp_path / "data", split)
    bad = TrainRunner(data, runner.checkpoint_dir)
    intact = runner.data.imgs / victim.name
    assert bad.main("bad", *ARGS, "--num-workers", workers) == 2
    error = one_error_line(capsys.readouterr().err)
    interrupted = runner.run_dir("bad") / "INTERRUPTED.pth"
    assert str(victim) in error and f"saved {interrupted}" in error and "--resume auto" in error, error
    state = load_checkpoint(interrupted)
    if split == "validation":
        # The epoch was trained, then its validation found the file: the epoch is kept.
        assert (state["epoch"], state["step_in_epoch"], state["global_step"]) == (1, 0, 6)
    else:
        assert state["epoch"] == 0 and state["global_step"] == state["step_in_epoch"] < 6

    # Fixed, the run continues from there.
    shutil.copyfile(intact, victim)
    assert bad.main("bad", *ARGS, "--num-workers", workers, "--resume", "auto") == 0
    assert load_checkpoint(runner.run_dir("bad") / "last.pth")["global_step"] == 12


def test_a_mask_value_outside_mask_values_is_an_error_naming_the_file(tmp_path: Path) -> None:
    imgs, masks = tmp_path / "imgs", tmp_path / "masks"
    imgs.mkdir()
    masks.mkdir()
    for index in range(2):
        Image.fromarray(np.full((8, 8, 3), 100, dtype=np.uint8)).save(imgs / f"a{index}.png")
        mask = np.zeros((8, 8), dtype=np.uint8)
        mask[:4] = 255
        Image.fromarray(mask).save(masks / f"a{index}.png")
    dataset = BasicDataset(imgs, masks, 1.0, cache_dir=tmp_path / "cache")
    assert dataset.mask_values == [0, 255]
    changed = np.zeros((8, 8), dtype=np.uint8)
    changed[0, 0] = 7
    Image.fromarray(changed).save(masks / "a1.png")  # after the scan, as a file edited during a run
    assert dataset[0]["mask"].max() == 1
    with pytest.raises(DatasetError, match=rf"{masks / 'a1.png'} holds mask value\(s\) \[7\] that are not among"):
        dataset[1]


@pytest.mark.slow
@pytest.mark.parametrize(("split", "rank"), [("training", 0), ("training", 1), ("validation", None)])
def test_with_two_processes_a_bad_file_stops_every_rank_after_saving(
    runner: TrainRunner, tmp_path: Path, split: str, rank: int | None
) -> None:
    # In training only the rank whose shard holds the file meets it; the others must not be left in the gradient
    # all-reduce (they would end with "lost contact", and the trained steps would be lost). Rank 1's error is
    # printed by rank 0.
    data, victim = _copy_with_a_truncated_image(runner.data, tmp_path / "data", split, trained_by_rank_of_two=rank)
    bad = TrainRunner(data, runner.checkpoint_dir)
    launcher = bad.popen(torchrun_prefix(2), "bad2", *ARGS, "--ddp_mode", "--num-workers", "1")
    out, err = finish(launcher)
    assert launcher.returncode != 0
    errors = [line for line in err.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and str(victim) in errors[0] and "INTERRUPTED.pth" in errors[0], out + err
    # Rank 0 printed the error and left first. Every rank shuts its loader workers down at once: a rank that took
    # another's error used to leave them to the garbage collector, 5 s each, and torchrun then named the wrong rank.
    assert names_rank_0_with_status_2(torchrun_root_cause(err)), err
    state = load_checkpoint(runner.run_dir("bad2") / "INTERRUPTED.pth")
    # 12 training images, 2 processes x batch 2: 3 steps per epoch.
    if split == "validation":
        assert (state["epoch"], state["global_step"], state["world_size"]) == (1, 3, 2)  # the epoch is kept
    else:
        # The victim is in its rank's last batch: the two steps before it are kept.
        assert (state["epoch"], state["global_step"], state["step_in_epoch"], state["world_size"]) == (0, 2, 2, 2)
        assert errors[0].startswith("Error: rank 1: ") == (rank == 1), errors[0]
