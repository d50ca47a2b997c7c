"""Real multi-process runs on CPU with gloo: the launch modes, DDP == one process, SIGTERM and a bit-exact resume.

Process start-up dominates on a small machine, so three launches cover everything: a manual launch (reference run),
a torchrun launch interrupted by SIGTERM, and its resume through the legacy ``torch.distributed.launch`` without
``--ddp_mode``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import (
    SyntheticData,
    TrainRunner,
    assert_same_training_state,
    finish,
    free_port,
    load_checkpoint,
    torchrun_prefix,
    wait_for_step,
    worker_pids,
)
from tests.helpers import read_metrics

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc to find worker processes"),
]

# 16 images, 25 % validation: 12 training images = 3 global batches of 4 per epoch, with 2 ranks x 2 or 1 x 4.
# 30 planned epochs keep the interrupted run going long after the signal; the compared runs stop at STOP_AT.
# (TrainRunner adds --threads 1 --deterministic: every process of every run uses the same single-threaded kernels,
# whatever this machine's CPU count, affinity mask or load.)
COMMON = ["-v", "25", "-e", "30", "--classes", "1", "--log-every", "1"]
STOP_AT = 9


@pytest.fixture(scope="module")
def ddp_reference(carvana_data: SyntheticData, tmp_path_factory: pytest.TempPathFactory) -> TrainRunner:
    """Manual launch, one `python train.py --ddp_mode --rank R --world-size 2 --dist-url tcp://...` per rank.

    Rank 1 gets a checkpoint folder of its own, which must stay empty: global rank 0 is the only writer.
    """
    runner = TrainRunner(carvana_data, tmp_path_factory.mktemp("ddp") / "checkpoints")
    url = f"tcp://127.0.0.1:{free_port()}"
    rank1_dir = runner.checkpoint_dir.parent / "rank1-checkpoints"
    ranks = [
        runner.popen([sys.executable], "reference", *COMMON, "-b", "2", "--sync-bn", "--max-steps", str(STOP_AT),
                     "--ddp_mode", "--rank", str(rank), "--world-size", "2", "--dist-url", url,
                     *(["--checkpoint-dir", str(rank1_dir)] if rank else []))
        for rank in range(2)
    ]  # fmt: skip
    for process in ranks:
        out, err = finish(process)
        assert process.returncode == 0, out + err
    assert not rank1_dir.exists() or not any(rank1_dir.rglob("*"))
    return runner


def train_losses(run_dir: Path) -> list[float]:
    return [event["loss"] for event in read_metrics(run_dir, event="train")]


def test_two_processes_with_sync_bn_equal_one_process_with_twice_the_batch(ddp_reference: TrainRunner) -> None:
    runner = ddp_reference
    # A process of its own, like the reference: in the pytest process the run would inherit whatever state earlier
    # tests of this worker left behind (thread pool, deterministic-algorithm switch), which depends on the order in
    # which a busy machine's xdist workers happen to take the tests.
    single_run = runner.popen([sys.executable], "single", *COMMON, "-b", "4", "--max-steps", str(STOP_AT))
    out, err = finish(single_run)
    assert single_run.returncode == 0, out + err
    ddp = load_checkpoint(runner.run_dir("reference") / "last.pth")
    single = load_checkpoint(runner.run_dir("single") / "last.pth")
    assert (ddp["world_size"], single["world_size"]) == (2, 1)
    assert ddp["global_step"] == single["global_step"] == STOP_AT

    # Same global batches, a loss that is a mean over images, synchronised BatchNorm: the same losses at every step...
    assert train_losses(runner.run_dir("reference")) == pytest.approx(train_losses(runner.run_dir("single")), rel=1e-5)
    # ...and the same weights and BatchNorm statistics after two epochs (6 steps), up to float summation order.
    # (Unsynchronised BatchNorm makes them differ by more than the training moved them.) Bit-equality is out of reach
    # in float32: one process sums 4 images' gradients in one kernel, DDP sums 2 per rank then averages in gloo's
    # all-reduce, and sync BatchNorm all-reduces its sums; the orders differ, so the last bits do. The difference
    # grows with the steps: Adam divides each update by its own gradient's size, so elements whose gradient is ~0
    # turn rounding noise into updates of up to the learning rate; hence the comparison after a few steps.
    # Measured with each run in a process of its own (2 cores, quiet and beside two busy loops: the same figures to
    # the last digit, the runs are deterministic): the worst element is at 0.12 of this tolerance, max |difference|
    # 1.9e-5; a control, the same single-process run with 1 and with 2 threads (only the summation order changes),
    # differs by 5.7e-6, 0.04 of it. So the tolerance is 8x the measured noise and 30x finer than what the training
    # moved (below).
    ddp = load_checkpoint(runner.run_dir("reference") / "checkpoint_epoch2.pth")
    single = load_checkpoint(runner.run_dir("single") / "checkpoint_epoch2.pth")
    assert ddp["global_step"] == single["global_step"] == 6
    initial = initial_weights(single["model_args"])
    for key, value in single["model_state"].items():
        other = ddp["model_state"][key]
        if value.is_floating_point():
            assert torch.allclose(value.double(), other.double(), rtol=1e-3, atol=1e-4), key
        else:
            assert torch.equal(value, other), key  # num_batches_tracked
    moved = (single["model_state"]["inc.double_conv.0.weight"] - initial["inc.double_conv.0.weight"]).abs().max()
    assert moved > 3e-3  # about one learning rate per step: the comparison is 30x finer than the training


def initial_weights(model_args: dict) -> dict[str, torch.Tensor]:
    """The weights every run starts from (--seed 0)."""
    from unet import UNet

    torch.manual_seed(0)
    return UNet(**model_args).state_dict()


def test_sigterm_to_one_rank_stops_all_and_resume_is_bit_exact(ddp_reference: TrainRunner) -> None:
    runner = ddp_reference
    run_dir = runner.run_dir("interrupted")
    launcher = runner.popen(torchrun_prefix(2), "interrupted", *COMMON, "-b", "2", "--sync-bn", "--ddp_mode")
    wait_for_step(run_dir / "metrics.jsonl", 1, launcher)
    # Only rank 1 is signalled: the ranks must still agree to stop at the same step, and rank 0 must save.
    os.kill(worker_pids(launcher.pid)[1], signal.SIGTERM)
    out, err = finish(launcher)
    assert launcher.returncode != 0
    assert "[rank 0] WARNING Stopped by SIGTERM" in out and "--resume auto" in out
    assert "[rank 1]" not in out  # rank 0 speaks for the job
    assert (out + err).count("exitcode  : 143") >= 1  # torchrun's report of the workers' exit status
    interrupted = load_checkpoint(run_dir / "INTERRUPTED.pth")
    assert interrupted["world_size"] == 2 and 1 <= interrupted["global_step"] < STOP_AT

    # Resume through the legacy launcher without --ddp_mode: it passes --local-rank, and two processes without
    # --ddp_mode switch DDP on instead of running two trainings that overwrite each other.
    legacy = [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node=2", f"--master_port={free_port()}"]
    resumed = runner.popen(legacy, "interrupted", *COMMON, "-b", "2", "--sync-bn", "--max-steps", str(STOP_AT),
                           "--resume", "auto")  # fmt: skip
    out, err = finish(resumed)
    assert resumed.returncode == 0, out + err
    assert "DDP switched on" in out + err
    assert_same_training_state(runner.run_dir("reference") / "last.pth", run_dir / "last.pth")


def test_two_torchrun_nodes_on_localhost_train_like_one_node(ddp_reference: TrainRunner) -> None:
    """Multi-node rendezvous (c10d) with two 'nodes' on 127.0.0.1; only the node holding global rank 0 writes."""
    runner = ddp_reference
    endpoint = f"127.0.0.1:{free_port()}"
    node_dirs = [runner.checkpoint_dir.parent / f"node{node}-checkpoints" for node in range(2)]
    nodes = []
    for node, node_dir in enumerate(node_dirs):
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node_rank={node}",
            "--nproc_per_node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            "--rdzv-id=nodes",
        ]
        nodes.append(TrainRunner(runner.data, node_dir).popen(
            launcher, "nodes", *COMMON, "-b", "2", "--sync-bn", "--max-steps", str(STOP_AT), "--ddp_mode"))  # fmt: skip
    for process in nodes:
        out, err = finish(process)
        assert process.returncode == 0, out + err
    # c10d assigns global ranks in joining order, so either node may hold rank 0; exactly one node wrote anything.
    writers = [node_dir for node_dir in node_dirs if node_dir.exists() and any(node_dir.rglob("*.pth"))]
    assert len(writers) == 1, writers
    assert not any(other.exists() and any(other.rglob("*")) for other in node_dirs if other != writers[0])
    assert_same_training_state(runner.run_dir("reference") / "last.pth", writers[0] / "nodes" / "last.pth")
