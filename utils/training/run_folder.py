"""The run folder ``<checkpoint_dir>/<exp_name>/``: the one owner of its path and of every file name in it.

It holds (checkpoints all in the one format of ``utils/checkpoint.py``):

* ``last.pth``: the newest state, written at every epoch end, every ``--save-every-steps`` optimizer steps and when
  ``--max-steps`` stops the run (mid-epoch states carry their position in ``step_in_epoch``);
* ``checkpoint_epoch{N}.pth``: every ``--save_every`` epochs, the newest ``--keep-last`` kept;
* ``best.pth``: the state with the best validation Dice;
* ``INTERRUPTED.pth``: written when SIGINT/SIGTERM stopped the run;
* ``metrics.jsonl`` and ``curves.png``.

``--resume auto`` takes the most recently written checkpoint that loads completely; a corrupt one is skipped with a
warning, and a folder without checkpoints starts a new run (so one command serves the first start and every restart
of a requeued job). Only global rank 0 writes here.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from utils.checkpoint import PARTIAL_FILE_PATTERN
from utils.errors import CheckpointError, ConfigError
from utils.training.state import load_resume_checkpoint

logger = logging.getLogger(__name__)

LAST_NAME = "last.pth"
BEST_NAME = "best.pth"
INTERRUPTED_NAME = "INTERRUPTED.pth"
METRICS_NAME = "metrics.jsonl"
CURVES_NAME = "curves.png"
_EPOCH_PATTERN = re.compile(r"^checkpoint_epoch(\d+)\.pth$")


def epoch_checkpoint_name(epoch_number: int) -> str:
    return f"checkpoint_epoch{epoch_number}.pth"


class RunFolder:
    """Paths, listing, resume choice, pruning and clean-up of one run folder."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @classmethod
    def of(cls, checkpoint_dir: str | Path, exp_name: str) -> RunFolder:
        return cls(Path(checkpoint_dir) / exp_name)

    def __str__(self) -> str:
        return str(self.path)

    @property
    def last(self) -> Path:
        return self.path / LAST_NAME

    @property
    def best(self) -> Path:
        return self.path / BEST_NAME

    @property
    def interrupted(self) -> Path:
        return self.path / INTERRUPTED_NAME

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_NAME

    @property
    def curves(self) -> Path:
        return self.path / CURVES_NAME

    def epoch_checkpoint(self, epoch_number: int) -> Path:
        return self.path / epoch_checkpoint_name(epoch_number)

    def check_creatable(self) -> None:
        """A run folder that cannot exist (a file in its way) stops the run now rather than at its first save."""
        existing = self.path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            raise ConfigError(
                f"the run folder {self.path} cannot be created: {existing} is a file, not a folder; choose another "
                f"--checkpoint-dir (or --exp_name)"
            )

    def checkpoints(self) -> list[Path]:
        """Checkpoints of the run folder, most recently written first."""
        if not self.path.is_dir():
            return []
        names = {LAST_NAME, BEST_NAME, INTERRUPTED_NAME}
        files = [p for p in self.path.iterdir() if p.is_file() and (p.name in names or _EPOCH_PATTERN.match(p.name))]
        return sorted(files, key=lambda p: p.stat().st_mtime_ns, reverse=True)

    def find_resume_checkpoint(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest complete checkpoint and its contents, None when the folder holds no checkpoint.

        Corrupt or incomplete files are skipped with a warning; if there are only such files, that is an error rather
        than a fresh start that would overwrite them.
        """
        candidates = self.checkpoints()
        for path in candidates:
            try:
                return path, load_resume_checkpoint(path)
            except CheckpointError as error:
                logger.warning("skipping %s for --resume auto: %s", path, error)
        if candidates:
            raise CheckpointError(
                f"--resume auto found no usable checkpoint in {self.path} (all are corrupt or incomplete, see above); "
                f"pass a checkpoint with --resume PATH, or move the folder away to start a new run"
            )
        return None

    def prune_epoch_checkpoints(self, keep_last: int) -> list[Path]:
        """Delete all but the newest ``keep_last`` checkpoint_epoch files (by epoch number); returns those deleted."""
        if keep_last <= 0 or not self.path.is_dir():
            return []
        numbered = []
        for path in self.path.iterdir():
            match = _EPOCH_PATTERN.match(path.name)
            if match:
                numbered.append((int(match.group(1)), path))
        numbered.sort()
        doomed = [path for _, path in numbered[:-keep_last]]
        for path in doomed:
            path.unlink(missing_ok=True)
        return doomed

    def remove_partial_files(self) -> list[Path]:
        """Delete the temporary files that writes killed mid-way left behind; returns their paths.

        Call it only when nothing writes to the folder (a run's start): the files of a write in progress look the same.
        """
        if not self.path.is_dir():
            return []
        removed = []
        for candidate in self.path.iterdir():
            if PARTIAL_FILE_PATTERN.match(candidate.name) and candidate.is_file():
                candidate.unlink(missing_ok=True)
                removed.append(candidate)
        return removed
