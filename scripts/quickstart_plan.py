"""What a (re)run of scripts/quickstart.sh trains, decided from the demo's run folders and the images in data/imgs.

    python -m scripts.quickstart_plan --checkpoint-dir checkpoints --exp-name demo --imgs data/imgs --epochs 4

Prints the run folder the quick start predicts with, then a line for the user (empty when there is nothing to say),
then the train.py flags of the plan, one a line (none: nothing to train). The cases:

- no run yet: a new run of ``--epochs`` (``--resume auto``, so that a quick start stopped half-way continues);
- a run that stopped before the end of its epochs, on the same images: ``--resume auto`` continues it;
- a finished run of E epochs on the same images, asked for N > E: a new run from its ``last.pth`` (``--load``)
  trains epochs E+1..N, in the series' next folder;
- a finished run of at least N epochs: nothing to train;
- other images in data/imgs than the run was trained on (the user's own, for example): a new run in the series'
  next folder, trained from scratch.

"The same images" means the same image ids as the run's ``split.json`` records; a run folder without one (written by
an older version) is taken to hold the same images.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from utils.checkpoint.run_folder import RunFolder, RunSeries
from utils.datasets.image_files import split_name
from utils.datasets.splits import read_split_file
from utils.errors import count
from utils.launch.process_group import run_main
from utils.training.config import TrainConfig


@dataclass(frozen=True)
class QuickstartPlan:
    """The folder the run ends in, what to tell the user, and train.py's flags (empty: train nothing)."""

    folder: RunFolder
    message: str
    train_flags: tuple[str, ...]


def image_ids(imgs_dir: Path) -> set[str]:
    """The ids (file names without extension) of the images in ``imgs_dir``, as the dataset names them."""
    names = (entry.name for entry in imgs_dir.iterdir() if entry.is_file() and not entry.name.startswith("."))
    return {parts[0] for parts in map(split_name, names) if parts is not None}


def trained_ids(folder: RunFolder) -> set[str] | None:
    """The image ids ``folder``'s run trained and validated on; None when the folder does not record them."""
    if not folder.split.is_file():
        return None
    record = read_split_file(folder.split)
    return {*record.train, *record.validation}


def plan_quickstart(checkpoint_dir: Path, exp_name: str, imgs_dir: Path, epochs: int) -> QuickstartPlan:
    """The plan for a quick start asked to train ``epochs`` epochs of ``exp_name`` on ``imgs_dir`` (see module doc)."""
    series = RunSeries(checkpoint_dir, exp_name)
    newest = series.newest()
    found = newest.find_resume_checkpoint() if newest.path.is_dir() else None
    fresh = ("--exp_name", exp_name, "--epochs", str(epochs))
    if found is None:
        return QuickstartPlan(newest, "", (*fresh, "--resume", "auto"))
    path, state = found
    next_folder = series.folder(series.newest_number() + 1)
    recorded = trained_ids(newest)
    if recorded is not None and recorded != image_ids(imgs_dir):
        message = (
            f"{imgs_dir} holds other images than {newest} was trained on: training a new model in {next_folder} "
            f"({newest} is kept)"
        )
        return QuickstartPlan(next_folder, message, fresh)
    done = state.position.epoch
    _, last = TrainConfig.from_dict(state.run_args).epoch_range()
    if done < last:
        message = f"Continuing the stopped run in {newest} (epoch {done} of {last} done) with --resume auto"
        return QuickstartPlan(newest, message, (*fresh, "--resume", "auto"))
    if done >= epochs:
        trained = count(done, "epoch")
        message = f"{newest} holds a model trained for {trained}: nothing to train (set DEMO_EPOCHS above {done})"
        return QuickstartPlan(newest, message, ())
    message = (
        f"Training on to epoch {epochs}: a new run in {next_folder} starts from the weights of {path} (epoch {done}) "
        f"with --load and trains epochs {done + 1}..{epochs}"
    )
    flags = ("--exp_name", exp_name, "--load", str(path), "--start_from", str(done + 1), "--epochs", str(epochs - done))
    return QuickstartPlan(next_folder, message, flags)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--exp-name", required=True)
    parser.add_argument("--imgs", type=Path, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    args = parser.parse_args(argv)

    def show_plan() -> int:
        plan = plan_quickstart(args.checkpoint_dir, args.exp_name, args.imgs, args.epochs)
        print("\n".join([str(plan.folder), plan.message, *plan.train_flags]))
        return 0

    # A run folder whose checkpoints are all damaged is one Error: line (exit 2), as in train.py.
    return run_main(show_plan, oom_fix="")


if __name__ == "__main__":
    sys.exit(main())
