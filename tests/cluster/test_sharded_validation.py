"""Sharded validation: every rank scores a disjoint part, the sums are all-reduced, the scores equal rank 0's; and the
trainer's Validator, whose --val-mode rank0 is the same reduce with the whole set on rank 0 and a stop agreed on."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset

from tests.conftest import run_ranks
from tests.helpers import tiny_unet
from utils.evaluation import EvalResult, evaluate_segmentation, score_batches, shard_range
from utils.launch.process_group import DistributedContext
from utils.launch.signals import InterruptFlag
from utils.training.loop import Validator

N_CLASSES = 3


def test_shard_ranges_cover_every_item_once() -> None:
    for n_items in range(0, 12):
        for world_size in range(1, 5):
            parts = [shard_range(n_items, rank=rank, world_size=world_size) for rank in range(world_size)]
            assert [i for part in parts for i in part] == list(range(n_items))
            if n_items:
                assert len(parts[0]) > 0  # rank 0 always has an image (it draws the wandb sample)
    assert [len(shard_range(4, rank=rank, world_size=3)) for rank in range(3)] == [2, 2, 0]


def _validation_set(n_items: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [
        {
            "image": torch.rand(3, 32, 48, generator=generator),
            "mask": torch.randint(0, N_CLASSES, (32, 48), generator=generator),
        }
        for _ in range(n_items)
    ]


def _score_on_rank(rank: int, world_size: int, n_items: int, store: str, results: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        model = tiny_unet(0, n_classes=N_CLASSES)  # with BatchNorm: scored in eval mode, no collective of its own
        part = Subset(_validation_set(n_items), shard_range(n_items, rank=rank, world_size=world_size))
        metrics = score_batches(
            model, DataLoader(part, batch_size=2), torch.device("cpu"), n_classes=N_CLASSES, progress=False
        )

        def all_reduce(sums: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(sums)
            return sums

        metrics.reduce(all_reduce)
        torch.save(metrics.compute().as_dict(), os.path.join(results, f"rank{rank}.pth"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked gloo processes")
@pytest.mark.parametrize(("world_size", "n_items"), [(2, 5), (3, 4)])  # uneven; (3, 4): the last rank has no image
def test_sharded_scores_equal_rank0_scores(tmp_path: Path, world_size: int, n_items: int) -> None:
    whole = evaluate_segmentation(
        tiny_unet(0, n_classes=N_CLASSES),
        DataLoader(_validation_set(n_items), batch_size=2),
        torch.device("cpu"),
        n_classes=N_CLASSES,
        progress=False,
    ).as_dict()
    run_ranks(_score_on_rank, (world_size, n_items, str(tmp_path / "store"), str(tmp_path)), world_size)
    for rank in range(world_size):
        sharded = torch.load(tmp_path / f"rank{rank}.pth", weights_only=False)
        assert sharded["n_images"] == whole["n_images"] == n_items
        for key in ("dice", "iou"):
            assert sharded[key] == pytest.approx(whole[key], abs=1e-6)
        for key in ("per_class_dice", "per_class_iou"):
            assert sharded[key] == pytest.approx(whole[key], abs=1e-6)
        for reduction in ("macro", "micro"):
            for key in ("dice", "iou", "dice_with_background"):
                assert sharded["reductions"][reduction][key] == pytest.approx(
                    whole["reductions"][reduction][key], abs=1e-6
                )
    assert 0 < whole["dice"] < 1, "a score of 0 or 1 everywhere would prove nothing"


@pytest.mark.slow
def test_train_py_sharded_validation_scores_like_rank0(runner) -> None:
    """Two real ranks under torchrun: --val-mode sharded logs the validation scores of --val-mode rank0."""
    from tests.conftest import finish, torchrun_prefix
    from tests.helpers import read_metrics

    scores = {}
    for mode in ("rank0", "sharded"):
        process = runner.popen(torchrun_prefix(2), mode, "--ddp_mode", "-e", "1", "--val-mode", mode)
        out, err = finish(process)
        assert process.returncode == 0, err
        (validation,) = read_metrics(runner.run_dir(mode), event="val")
        scores[mode] = validation
    for key in ("dice", "iou"):
        assert scores["sharded"][key] == pytest.approx(scores["rank0"][key], abs=1e-6)
    assert scores["sharded"]["per_class_dice"] == pytest.approx(scores["rank0"]["per_class_dice"], abs=1e-6)


class _RecordingLog:
    """What the Validator asks of the ``RunLog``: a phase to time, no bars, and the results it reports."""

    bars = False

    def __init__(self) -> None:
        self.reported: list[EvalResult] = []

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def log_val(self, result: EvalResult) -> None:
        self.reported.append(result)


def _validate_on_rank(rank: int, store: str, results: str, signalled: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        cpu = torch.device("cpu")
        ctx = DistributedContext(
            rank=rank, local_rank=rank, world_size=2, local_world_size=2, device=cpu, distributed=True
        )
        # --val-mode rank0: the whole set on rank 0, nothing on rank 1 (utils.training.data.build_loaders).
        val = DataLoader(_validation_set(5), batch_size=2) if rank == 0 else None
        parts = SimpleNamespace(
            loaders=SimpleNamespace(val=val, val_sharded=False),
            evaluated_model=tiny_unet(0, n_classes=N_CLASSES),
            config=SimpleNamespace(model=SimpleNamespace(classes=N_CLASSES)),
            step=SimpleNamespace(precision="fp32"),
        )
        interrupts = InterruptFlag()  # never installed: the signal is set as its handler records it, on rank 0 only
        interrupts.signum = signal.SIGTERM if signalled and rank == 0 else 0
        log = _RecordingLog()
        dice, stopped = Validator(ctx, parts, interrupts, log).validate()  # type: ignore[arg-type]
        torch.save(
            {"dice": dice, "stopped": stopped, "reported": len(log.reported)}, os.path.join(results, f"{rank}.pth")
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked gloo processes")
@pytest.mark.parametrize("signalled", [False, True])
def test_a_rank0_validation_gives_every_rank_its_score_or_its_stop(tmp_path: Path, signalled: bool) -> None:
    run_ranks(_validate_on_rank, (str(tmp_path / "store"), str(tmp_path), signalled), 2)
    first, second = (torch.load(tmp_path / f"{rank}.pth", weights_only=False) for rank in range(2))
    if signalled:
        # The signal rank 0 saw before its first batch stops both ranks, and a partial score is not reported.
        assert first == second == {"dice": None, "stopped": signal.SIGTERM, "reported": 0}
        return
    whole = evaluate_segmentation(
        tiny_unet(0, n_classes=N_CLASSES),
        DataLoader(_validation_set(5), batch_size=2),
        torch.device("cpu"),
        n_classes=N_CLASSES,
        progress=False,
    )
    assert first["dice"] == second["dice"] == pytest.approx(whole.dice, abs=1e-6) and 0 < whole.dice < 1
    assert (first["stopped"], second["stopped"], first["reported"], second["reported"]) == (0, 0, 1, 0)
