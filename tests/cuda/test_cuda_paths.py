"""The CUDA code paths, end to end on a real GPU: run by ``scripts/gpu_check.sh``, skipped where there is no GPU.

fp16 with its GradScaler (and an exact resume of the scaler's state), bf16, channels_last, pinned memory with
non-blocking copies, a one-process NCCL group, two DDP processes sharing one GPU over gloo, ``--compile``, and a real
out-of-memory error reaching the user as one line.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import TrainRunner, finish, load_checkpoint, torchrun_prefix
from tests.helpers import one_error_line, read_metrics, tiny_unet

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh runs these)"),
]

# cuBLAS is deterministic only with a fixed workspace; --deterministic refuses to run without it on CUDA.
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def train(runner: TrainRunner, name: str, *extra: str, prefix: list[str] | None = None) -> tuple[int, str, str]:
    """train.py as a real process on the GPU (a fresh CUDA context per run, as users get)."""
    process = runner.popen(prefix or [sys.executable], name, "--device", "cuda", *extra, env=DETERMINISTIC_ENV)
    out, err = finish(process, timeout=300)
    return process.returncode, out, err


def test_fp16_grad_scaler_trains_and_resumes_exactly(runner: TrainRunner) -> None:
    code, _, err = train(runner, "straight", "-e", "2", "--precision", "fp16")
    assert code == 0, err
    straight = load_checkpoint(runner.run_dir("straight") / "last.pth")
    scaler = straight["scaler"]
    assert scaler is not None and scaler["scale"] > 0, "fp16 on CUDA must train with a GradScaler"

    epoch1 = str(runner.run_dir("straight") / "checkpoint_epoch1.pth")
    code, _, err = train(runner, "resumed", "-e", "2", "--precision", "fp16", "--resume", epoch1)
    assert code == 0, err
    resumed = load_checkpoint(runner.run_dir("resumed") / "last.pth")
    assert resumed["scaler"] == scaler, "the GradScaler's scale and growth tracker must resume exactly"
    assert (resumed["epoch"], resumed["global_step"]) == (straight["epoch"], straight["global_step"])
    # cuDNN and atomics may sum in another order from run to run (README), so the weights agree closely, not bitwise.
    for key, tensor in straight["model_state"].items():
        assert torch.allclose(resumed["model_state"][key].float(), tensor.float(), rtol=1e-3, atol=1e-4), key


@pytest.mark.parametrize("extra", [("--precision", "bf16"), ("--precision", "bf16", "--channels-last")])
def test_bf16_and_channels_last_train(runner: TrainRunner, extra: tuple[str, ...]) -> None:
    code, _, err = train(runner, "bf16", "-e", "1", *extra)
    assert code == 0, err
    losses = [event["loss"] for event in read_metrics(runner.run_dir("bf16"), event="train")]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    assert load_checkpoint(runner.run_dir("bf16") / "last.pth")["scaler"] is None, "bf16 needs no GradScaler"


def test_pinned_batches_copy_without_blocking(carvana_data) -> None:
    from utils.launch.process_group import DistributedContext
    from utils.training.config import parse_config
    from utils.training.data import build_data, build_loaders

    folders = ["--imgs", str(carvana_data.imgs), "--masks", str(carvana_data.masks)]
    config = parse_config([*folders, "--scale", "1", "--batch-size", "4", "--num-workers", "2"])
    cuda = DistributedContext(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cuda", 0))
    batch = next(iter(build_loaders(config, cuda, build_data(config)).train))
    assert batch["image"].is_pinned() and batch["mask"].is_pinned()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        image = batch["image"].to("cuda", non_blocking=True)
        mask = batch["mask"].to("cuda", non_blocking=True)
    stream.synchronize()
    assert torch.equal(image.cpu(), batch["image"]) and torch.equal(mask.cpu(), batch["mask"])


def test_one_process_nccl_group_trains(runner: TrainRunner) -> None:
    code, out, err = train(runner, "nccl", "--ddp_mode", "-e", "1", prefix=torchrun_prefix(1))
    assert code == 0, f"{out}\n{err}"
    assert load_checkpoint(runner.run_dir("nccl") / "last.pth")["world_size"] == 1


def _ddp_rank(rank: int, store: str, batch: torch.Tensor, masks: torch.Tensor, out: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        model = DistributedDataParallel(tiny_unet(0).cuda().eval(), device_ids=[0])
        half = slice(rank * 2, rank * 2 + 2)
        F.cross_entropy(model(batch[half].cuda()), masks[half].cuda()).backward()
        if rank == 0:
            torch.save({name: p.grad.cpu() for name, p in model.module.named_parameters()}, out)
    finally:
        dist.destroy_process_group()


def test_two_ddp_processes_share_one_gpu_over_gloo(tmp_path: Path) -> None:
    import torch.multiprocessing as mp
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    batch = torch.rand(4, 3, 32, 48, generator=generator)
    masks = torch.randint(0, 2, (4, 32, 48), generator=generator)
    out = tmp_path / "grads.pt"
    mp.spawn(_ddp_rank, args=(str(tmp_path / "store"), batch, masks, str(out)), nprocs=2, join=True)
    shared = torch.load(out, weights_only=True)

    # eval(): BatchNorm uses its running statistics, so two halves average to exactly the full batch's gradient.
    model = tiny_unet(0).cuda().eval()
    F.cross_entropy(model(batch.cuda()), masks.cuda()).backward()
    moved = 0
    for name, parameter in model.named_parameters():
        assert torch.allclose(shared[name], parameter.grad.cpu(), rtol=1e-4, atol=1e-6), name
        moved += int(parameter.grad.abs().sum() > 0)
    assert moved > len(shared) // 2, "most gradients must be non-zero for the comparison to mean something"


def test_compile_end_to_end(runner: TrainRunner) -> None:
    code, _, err = train(runner, "compiled", "-e", "1", "--compile", "--max-steps", "4", "--precision", "bf16")
    assert code == 0, err
    assert read_metrics(runner.run_dir("compiled"), event="train")


def test_real_out_of_memory_is_one_line(runner: TrainRunner) -> None:
    # A 16 MiB allocator budget: the base-64 model's 124 MB of weights cannot reach the GPU.
    budget = 16 * 2**20 / torch.cuda.get_device_properties(0).total_memory
    code = (
        f"import sys, torch; torch.cuda.set_per_process_memory_fraction({budget!r}); import train; "
        "sys.exit(train.main(sys.argv[2:]))"
    )
    status, _, err = train(runner, "oom", "-e", "1", "--base-channels", "64", prefix=[sys.executable, "-c", code])
    assert status == 2, err
    line = one_error_line(err)
    assert line.startswith("Error: CUDA ran out of memory") and "--batch-size" in line, err
