"""Which run folder a training run writes and which checkpoint it resumes: one choice, made by global rank 0.

No write may land on a newer state or on another run, so:

* no ``--resume``: a new folder of the series (``RunSeries.start_new``);
* ``--resume auto``, and a torchrun restart without ``--resume``: the newest folder, from its newest checkpoint;
* ``--resume PATH``: the folder PATH lies in when PATH holds that folder's newest state
  (``RunFolder.can_continue_from``); else (an older state of its folder, or a file from outside the series) a new
  folder, as a rerun takes;
* a torchrun restart of ``--resume PATH``: the folder the first attempt took, from its newest checkpoint (PATH again
  would throw away that attempt's progress), and from PATH only while that folder holds none.

A locked folder is never continued or written. The folder names and the lock belong to ``utils.training.run_folder``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from utils.errors import CheckpointError
from utils.launch.process_group import DistributedContext, decide_on_main
from utils.training.config import RESUME_AUTO
from utils.training.run_folder import RunFolder, RunSeries
from utils.training.state import load_resume_checkpoint

logger = logging.getLogger(__name__)


@dataclass
class RunChoice:
    """The run folder (locked on global rank 0) and the checkpoint to resume (None: a new run)."""

    folder: RunFolder
    resume_path: str | None = None
    payload: dict[str, Any] | None = None
    """The resume checkpoint as rank 0 read it while choosing (kept to spare reading a large file twice); None on
    other ranks, which read it themselves."""


def agree_on_run(ctx: DistributedContext, resume: str | None, series: RunSeries) -> RunChoice:
    """Rank 0 chooses (and locks) the folder and the checkpoint; every rank and node gets the folder and file."""
    mine: list[RunChoice] = []

    def decide() -> tuple[str, str | None]:
        mine.append(choose_run(resume, series, ctx.restart_count))
        return str(mine[0].folder.path), mine[0].resume_path

    folder_path, resume_path = decide_on_main(ctx, decide)
    return mine[0] if mine else RunChoice(RunFolder(folder_path), resume_path)


def choose_run(resume: str | None, series: RunSeries, restart_count: int) -> RunChoice:
    """Rank 0's choice (see the module docstring); the folder is locked and cleared of interrupted writes."""
    if resume is None and restart_count == 0:
        return _took(series.start_new())
    if resume is None or resume == RESUME_AUTO:
        folder = _took(series.continue_newest()).folder
        found = folder.find_resume_checkpoint()
        if found is None:
            logger.info("--resume auto: no checkpoint in %s yet, starting a new run", folder)
            return RunChoice(folder)
        path, payload = found
        return RunChoice(folder, str(path), payload)
    if restart_count > 0:
        return _restart_from_path(resume, series, restart_count)
    return _resume_from_path(resume, series)


def _resume_from_path(resume: str, series: RunSeries) -> RunChoice:
    resume_path = Path(resume)
    payload = _read_resume_file(resume)
    own = series.contains(resume_path)
    if own is None:  # a file from outside the series: nothing of the series to continue
        return _took(series.start_new(), resume, payload)
    if own.take_to_continue(resume_path, payload):
        return _took(own, resume, payload)
    reason = f"--resume {resume} is not the newest state of {own} (continuing there would overwrite newer checkpoints)"
    return _took(series.start_new(reason), resume, payload)


def _restart_from_path(resume: str, series: RunSeries, restart_count: int) -> RunChoice:
    # The first attempt took either the folder PATH lies in or the series' newest (a new one, or an empty one).
    candidates = [folder for folder in (series.contains(Path(resume)), series.newest()) if folder is not None]
    first = series.taken_last(candidates)
    if first is None:  # neither was ever locked: the first attempt failed before it chose, so choose as it would have
        return _resume_from_path(resume, series)
    first.lock()
    _took(first)
    found = first.find_resume_checkpoint()
    if found is None:
        logger.info("torchrun restart %d: no checkpoint in %s yet, resuming --resume %s", restart_count, first, resume)
        return RunChoice(first, resume, _read_resume_file(resume))
    path, payload = found
    logger.info(
        "torchrun restart %d continues %s, the folder its first attempt took, from its newest checkpoint %s",
        restart_count,
        first,
        path,
    )
    return RunChoice(first, str(path), payload)


def _read_resume_file(resume: str) -> dict[str, Any]:
    path = Path(resume)
    if not path.is_file():
        raise CheckpointError(f"--resume {resume}: no such file; pass a checkpoint path or --resume auto")
    return load_resume_checkpoint(path)


def _took(folder: RunFolder, resume_path: str | None = None, payload: dict[str, Any] | None = None) -> RunChoice:
    """The choice of ``folder`` (locked by this process), after clearing what killed writes left there."""
    # Under the lock nothing else writes to the folder: a temporary file there is what a killed write left behind.
    for path in folder.remove_partial_files():
        logger.info("Removed %s, left behind by a checkpoint write that was interrupted", path)
    return RunChoice(folder, resume_path, payload)
