"""Large images: the activation estimate, the free-memory reading, and predict.py under a real memory limit."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import REPO_ROOT, child_env
from tests.helpers import make_model, one_error_line, save_checkpoint, structured_image, write_images
from utils.errors import UserError
from utils.inference.tiling import DOWNSAMPLING, MemoryPlanner, estimate_forward_bytes

MIB = 1024**2


def test_the_estimate_grows_with_area_batch_and_width():
    model = make_model(2)
    one = estimate_forward_bytes(model, 1, 256, 256)
    assert estimate_forward_bytes(model, 1, 512, 512) == 4 * one
    assert estimate_forward_bytes(model, 3, 256, 256) == 3 * one
    model.base_channels = 16
    assert estimate_forward_bytes(model, 1, 256, 256) > 1.9 * one


def test_the_planner_keeps_whole_images_that_fit_and_picks_the_largest_window_that_does():
    model = make_model(2)
    budget = 200 * MIB
    planner = MemoryPlanner(budget)
    assert planner.tile_if_needed(model, (1, 3, 256, 256), False, 1) is None
    tile = planner.tile_if_needed(model, (1, 3, 4096, 4096), False, 1)
    assert tile is not None and tile.size % DOWNSAMPLING == 0 and tile.overlap == 0.5
    stitched = 4096 * 4096 * 3 * 4
    windows = estimate_forward_bytes(model, 1, tile.size + DOWNSAMPLING, tile.size + DOWNSAMPLING)
    assert windows + stitched <= budget
    bigger = tile.size + DOWNSAMPLING
    assert estimate_forward_bytes(model, 1, bigger + DOWNSAMPLING, bigger + DOWNSAMPLING) + stitched > budget
    assert MemoryPlanner(None).tile_if_needed(model, (1, 3, 1 << 14, 1 << 14), False, 1) is None  # unknown: never guess


def test_too_little_memory_even_for_small_windows_is_a_user_error():
    with pytest.raises(UserError, match=r"a 8192x8192 image needs about .* GiB .* lower --scale"):
        MemoryPlanner(64 * MIB).tile_if_needed(make_model(2), (1, 3, 8192, 8192), False, 1)


# predict.main in a child whose address space is capped a little above what it maps after importing torch: the
# real allocator fails beyond that, so the test measures the planner against real memory, not a mocked reading.
_CHILD = textwrap.dedent(
    """
    import resource, sys
    import torch
    import predict
    torch.set_num_threads(1)
    mapped = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
    headroom = int(sys.argv[1]) * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mapped + headroom, resource.RLIM_INFINITY))
    sys.exit(predict.main(sys.argv[2:]))
    """
)
HEADROOM_MIB = 700
SIDE = 1536


def _predict_limited(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    image = tmp_path / "big.png"
    if not image.exists():
        Image.fromarray(structured_image(SIDE, SIDE)).save(image)
        save_checkpoint(tmp_path / "m.pth", make_model(2), [0, 1])
    argv = ["-m", str(tmp_path / "m.pth"), "-i", str(image), "-o", str(tmp_path / "big_mask.png"), "-s", "1"]
    command = [sys.executable, "-c", _CHILD, str(HEADROOM_MIB), *argv, "--workers", "0", "--no-progress", *extra]
    env = child_env({"OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"})
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_an_image_too_large_for_the_memory_limit_is_predicted_in_windows_with_one_warning(tmp_path):
    # About 950 MiB for the whole 1536x1536 image at base width 8, against 700 MiB of address space left.
    assert estimate_forward_bytes(make_model(2), 1, SIDE, SIDE) > HEADROOM_MIB * MIB
    done = _predict_limited(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stdout.splitlines() if "predicting in" in line]
    assert len(warnings) == 1 and "pass --tile" in warnings[0], done.stdout
    assert Image.open(tmp_path / "big_mask.png").size == (SIDE, SIDE)
    assert np.asarray(Image.open(tmp_path / "big_mask.png")).any()


@pytest.mark.slow
def test_the_control_a_whole_image_forced_under_that_limit_fails_with_one_line_suggesting_tile(tmp_path):
    # --tile as large as the image is one whole-image window: no planning, so the allocator itself fails.
    done = _predict_limited(tmp_path, "--tile", str(SIDE))
    assert done.returncode == 2, done.stderr[-3000:]
    line = one_error_line(done.stderr)
    assert "out of memory" in line and "--tile 512" in line
    assert not (tmp_path / "big_mask.png").exists()


def test_a_batch_over_the_budget_predicts_exactly_as_the_windows_the_planner_names(tmp_path, caplog):
    from utils.inference.config import PredictConfig
    from utils.inference.engine import PredictionInputs, predict_items
    from utils.inference.export import Preprocessing

    paths = write_images(tmp_path, [(160, 128)])
    model = make_model(2)
    dataset = PredictionInputs(paths, Preprocessing(1.0, [0, 1], 3), PredictConfig())
    budget = estimate_forward_bytes(model, 1, 128, 160) // 2
    planner = MemoryPlanner(budget)
    config = PredictConfig(batch_size=1, workers=0, no_progress=True)
    [planned] = predict_items(model, dataset, torch.device("cpu"), config, memory=planner)
    tile = MemoryPlanner(budget).tile_if_needed(model, (1, 3, 128, 160), False, 1)
    assert tile is not None and tile.size < 128
    windows = PredictConfig(batch_size=1, workers=0, no_progress=True, tile=tile.size, tile_overlap=tile.overlap)
    [explicit] = predict_items(model, dataset, torch.device("cpu"), windows)
    [whole] = predict_items(model, dataset, torch.device("cpu"), config, memory=MemoryPlanner(None))
    np.testing.assert_array_equal(planned.classes, explicit.classes)
    assert not np.array_equal(planned.classes, whole.classes)  # the control: windows really were used
