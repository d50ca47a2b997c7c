"""The benchmark's checkpoint section, run for real on a tiny model (base 8) through scripts/benchmark.py.

No timing assertions: every figure only has to exist, be positive and agree with the others and with the files.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from scripts import benchmark
from scripts.bench import checkpoint_io
from tests.helpers import positive, tiny_unet
from utils.launch.environments import is_launcher_variable


@pytest.mark.slow
def test_checkpoint_section_reports_every_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in filter(is_launcher_variable, list(os.environ)):
        monkeypatch.delenv(name)
    # The section copies with the real copy_checkpoint_atomic; this records the files it copied, as they are on disk.
    copies: list[tuple[int, int]] = []
    real_copy = checkpoint_io.copy_checkpoint_atomic

    def recording_copy(source: Path, target: Path) -> None:
        real_copy(source, target)
        copies.append((Path(source).stat().st_size, Path(target).stat().st_size))

    monkeypatch.setattr(checkpoint_io, "copy_checkpoint_atomic", recording_copy)
    bench_dir, out = tmp_path / "checkpoint-bench", tmp_path / "bench.json"
    argv = ["--quick", "--sections", "checkpoint", "--repeat", "3", "--checkpoint-bench-dir", str(bench_dir)]
    threads = torch.get_num_threads()
    try:
        status = benchmark.main([*argv, "--json", str(out), "--work-dir", str(tmp_path / "w")])
    finally:
        torch.set_num_threads(threads)
    stdout = capsys.readouterr().out
    assert status == 0, stdout
    result: dict[str, Any] = json.loads(out.read_text())["checkpoint"]

    assert result["base_channels"] == 8 and result["repeat"] == 3 and result["folder"] == str(bench_dir)
    assert result["filesystem"] and positive(result["tensors"])
    for measure in checkpoint_io.MEASURES:
        runs = result[f"{measure}_s_runs"]
        assert len(runs) == 3 and all(positive(seconds) for seconds in runs), measure
        assert result[f"{measure}_s"] == statistics.median(runs), measure

    # The reported size is that of the files written: the saved one and each copy of it.
    assert len(copies) == 3 and all(copy == (result["file_bytes"], result["file_bytes"]) for copy in copies)
    assert result["file_mb"] == result["file_bytes"] / 1e6
    # The weights and AdamW's two moments per weight, 4 bytes each, and little else: the optimizer state is in it.
    parameters = sum(p.numel() for p in tiny_unet().parameters())
    assert 3 * 4 * parameters < result["file_bytes"] < 1.1 * 3 * 4 * parameters

    ratios = result["copy_over_second_save_runs"]
    copy_runs, save_runs = result["copy_s_runs"], result["second_save_s_runs"]
    assert ratios == [copy / again for copy, again in zip(copy_runs, save_runs, strict=True)]
    assert result["copy_over_second_save"] == statistics.median(ratios)

    assert list(bench_dir.iterdir()) == [], "the section removes its temporary folder"
    assert not list((tmp_path / "w").rglob("*.pth")), "no checkpoint is left in the work folder"
    rows = [line for line in stdout.splitlines() if line.startswith("checkpoint ")]
    assert len(rows) == 6 and "FAILED" not in stdout


def test_checkpoint_flags_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert benchmark.main(["--quick", "--sections", "checkpoint", "--checkpoint-base-channels", "0"]) == 2
    assert "--checkpoint-base-channels must be at least 1" in capsys.readouterr().err
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    assert benchmark.main(["--quick", "--checkpoint-bench-dir", str(not_a_folder)]) == 2
    assert f"--checkpoint-bench-dir {not_a_folder} is a file" in capsys.readouterr().err
