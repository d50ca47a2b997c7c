"""Weights & Biases in offline mode: a real local run record, nothing sent over the network."""

from __future__ import annotations

import pytest

from tests.conftest import TrainRunner


def test_offline_wandb_writes_a_local_run(runner: TrainRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    # No API key and no network: offline mode must not need either.
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert runner.main("wb", "--epochs", "1", "--wandb", "offline", "--log-every", "1") == 0
    runs = list((runner.run_dir("wb") / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    records = list(runs[0].glob("*.wandb"))
    assert records and records[0].stat().st_size > 0
    # The validation sample (image, true mask, predicted mask) is logged as images.
    logged = {path.name.split("_")[0] for path in (runs[0] / "files" / "media" / "images").glob("*.png")}
    assert logged == {"images", "true", "pred"}
