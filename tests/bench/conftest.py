"""The benchmark run in the test's own process (saves an interpreter start; train.py and torchrun still run as real
child processes), with the launcher's variables cleared and torch's thread count put back afterwards."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from scripts import benchmark
from utils.launch.environments import is_launcher_variable


@dataclass
class BenchmarkRun:
    doc: dict[str, Any]
    """The JSON document it wrote."""
    stdout: str
    """Its table."""
    work_dir: Path
    """Its run folders and generated data."""


RunBenchmark = Callable[[Sequence[str]], BenchmarkRun]


@pytest.fixture
def run_benchmark(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> RunBenchmark:
    """``run(argv)``: ``scripts/benchmark.py`` with ``argv`` plus a JSON file and a work folder in ``tmp_path``; asserts
    it exits 0 and returns what it wrote."""
    for name in filter(is_launcher_variable, list(os.environ)):
        monkeypatch.delenv(name)

    def run(argv: Sequence[str]) -> BenchmarkRun:
        out, work_dir = tmp_path / "bench.json", tmp_path / "w"
        threads = torch.get_num_threads()
        try:
            status = benchmark.main([*argv, "--json", str(out), "--work-dir", str(work_dir)])
        finally:
            torch.set_num_threads(threads)
        captured = capsys.readouterr()
        stdout = captured.out
        assert status == 0, f"{stdout}\n{captured.err}"
        return BenchmarkRun(json.loads(out.read_text()), stdout, work_dir)

    return run
