"""A stop signal during validation ends it at the next batch and saves at once; the resumed run repeats it.

A real process and a real signal: validation is made long (many validation images), the signal is sent when
metrics.jsonl shows the epoch's last training step, and the saved state must be exactly that step.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

import pytest

from tests.conftest import SyntheticData, TrainRunner, finish, load_checkpoint, wait_for_step
from tests.helpers import read_metrics

TRAIN_STEPS = 5  # 10 training images, batch 2
ARGS = ["-e", "2", "-v", "98", "--log-every", "1", "--num-workers", "0"]


@pytest.fixture(scope="module")
def long_validation(tmp_path_factory: pytest.TempPathFactory) -> SyntheticData:
    """500 images of 64x64: 490 validate (seconds on a CPU), 10 train."""
    from utils.datasets.synthetic import generate_carvana_like

    root = tmp_path_factory.mktemp("long-validation")
    generate_carvana_like(root, 500, size=(64, 64), seed=0)
    return SyntheticData(root / "imgs", root / "masks", 500)


@pytest.mark.slow
def test_a_signal_during_validation_saves_the_trained_epoch_at_once(
    long_validation: SyntheticData, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # SIGTERM, as a scheduler sends it. SIGINT reaches the same handler (utils.launch.signals); its save and exit
    # status 130 are tested in test_train_signals.py, and a signal before validation's first batch in
    # test_trainer_units.py.
    signum = signal.SIGTERM
    runner = TrainRunner(long_validation, tmp_path / "checkpoints")
    run_dir = runner.run_dir("unet")
    process = runner.popen([sys.executable], "unet", *ARGS)
    wait_for_step(run_dir / "metrics.jsonl", TRAIN_STEPS, process, timeout_s=300)
    process.send_signal(signum)  # the epoch's last step is logged: validation of 490 images is under way
    out, err = finish(process)
    assert process.returncode == 128 + signum, err[-3000:]
    saved = load_checkpoint(run_dir / "INTERRUPTED.pth")
    # No further training batch: the state of the epoch's last step, with every batch of the epoch done.
    assert (saved["global_step"], saved["epoch"], saved["step_in_epoch"]) == (TRAIN_STEPS, 0, TRAIN_STEPS)
    assert not read_metrics(run_dir, event="val"), "a cut-short validation must not be reported"
    assert not (run_dir / "last.pth").exists()

    # The resume in this process (the signal and the save needed a process of their own; this does not).
    with caplog.at_level(logging.INFO):
        assert runner.main("unet", *ARGS, "--resume", "auto") == 0
    assert f"Resuming from {run_dir / 'INTERRUPTED.pth'}" in caplog.text
    validations = read_metrics(run_dir, event="val")
    # The resumed run repeats the validation of epoch 1 at the step it was cut at, then trains epoch 2.
    assert [(v["epoch"], v["global_step"]) for v in validations] == [(1, TRAIN_STEPS), (2, 2 * TRAIN_STEPS)]
