"""Logs without a terminal: no carriage-return bars, a loss line every --log-every steps and one line per epoch."""

from __future__ import annotations

import os
import re
import sys

from tests.conftest import TrainRunner, finish
from tests.helpers import read_metrics
from utils.training.run_log import bars_wanted


def test_bars_only_on_rank_0_on_a_terminal_without_no_progress(tmp_path) -> None:
    main_side, terminal_side = os.openpty()
    with os.fdopen(terminal_side, "w") as terminal, open(tmp_path / "log", "w") as file:
        assert bars_wanted(is_main=True, no_progress=False, stream=terminal)
        assert not bars_wanted(is_main=True, no_progress=True, stream=terminal)
        assert not bars_wanted(is_main=False, no_progress=False, stream=terminal)
        assert not bars_wanted(is_main=True, no_progress=False, stream=file)
    os.close(main_side)


def test_a_run_with_stderr_to_a_file_logs_lines_and_no_bars(runner: TrainRunner) -> None:
    process = runner.popen([sys.executable], "file-log", "-e", "2", "--log-every", "2")
    out, err = finish(process)
    assert process.returncode == 0, err
    text = out + err
    assert "\r" not in text
    # 16 images, 10% validation -> 15 training images, batch 2: 8 steps an epoch; lines at steps 2, 4, 6, 8 of each.
    steps = re.findall(
        r"epoch (\d)/2 step (\d+)/(\d+) \(global (\d+)\): loss ([\d.]+), lr \S+, [\d.]+ img/s, ETA (?:\?|\d+:\d\d)",
        text,
    )
    logged = read_metrics(runner.run_dir("file-log"), event="train")
    assert [int(step[3]) for step in steps] == [event["global_step"] for event in logged]
    assert [float(step[4]) for step in steps] == [round(event["loss"], 4) for event in logged]
    epochs = re.findall(
        r"epoch (\d)/2 done \(step (\d+)\): mean training loss ([\d.]+); validation Dice ([\d.]+)", text
    )
    assert [epoch[0] for epoch in epochs] == ["1", "2"]
    per_epoch = int(steps[0][2])
    assert per_epoch % 2 == 0, "the check below needs --log-every to divide the epoch"
    for number, end_step, mean, _ in epochs:
        window = [
            event["loss"] for event in logged if per_epoch * (int(number) - 1) < event["global_step"] <= int(end_step)
        ]
        assert abs(float(mean) - sum(window) / len(window)) < 1e-3
