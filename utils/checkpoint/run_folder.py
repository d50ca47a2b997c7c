"""The run folder ``<checkpoint_dir>/<exp_name>/``: the one owner of its path and of every file name in it.

It holds (checkpoints all in the one format of ``utils.checkpoint.format``):

* ``last.pth``: the newest state, written at every epoch end, every ``--save-every-steps`` optimizer steps and when
  ``--max-steps`` stops the run (mid-epoch states carry their position in ``step_in_epoch``);
* ``checkpoint_epoch{N}.pth``: every ``--save_every`` epochs, the newest ``--keep-last`` kept;
* ``best.pth``: the weights (and the model's spec) of the state with the best validation Dice: weights-only, the file
  to share and predict with, about a third of a full-state file with AdamW; not resumable (``--load`` starts from it);
* ``best-1.pth`` .. ``best-K.pth``: with ``--keep-best K``, the K best states by validation Dice, best first
  (weights-only like ``best.pth``);
* ``INTERRUPTED.pth``: written when SIGINT/SIGTERM stopped the run;
* ``metrics.jsonl`` and ``curves.png``;
* ``split.json``: the train and validation ids and the rule that chose them;
* ``config.yaml``: the run's resolved flags (``utils.training.config_file``; ``--config`` reads it);
* ``tensorboard/``: TensorBoard events, with ``--tensorboard``.

``--resume auto`` takes the checkpoint with the furthest position recorded inside it (global step, then epoch, then
step in the epoch; the most recently written breaks a tie) that loads completely (and passes its digest check). A
file's modification time never ranks it ahead: a copy or a sync changes mtimes, and an older state must never be
continued over newer checkpoints. A corrupt one is skipped with a warning, and a folder without checkpoints starts
a new run (so one command serves the first start and every restart of a requeued job). Only global rank 0 writes
here.

Reruns: the folders of one ``--exp_name`` form a series, ``<exp_name>``, ``<exp_name>-2``, ``<exp_name>-3``, ... Which
folder a run writes and which checkpoint it resumes is one choice, made by global rank 0 (``agree_on_run``); no write
may land on a newer state or on another run, and nothing is ever overwritten:

* no ``--resume``: a new folder of the series (``RunSeries.start_new``) when the newest holds a run (checkpoints or
  metrics) or is in use;
* ``--resume auto``, and a torchrun restart without ``--resume``: the newest folder, from its newest checkpoint;
* ``--resume PATH``: the folder PATH lies in when PATH holds that folder's newest state
  (``RunFolder.can_continue_from``); else (an older state of its folder, or a file from outside the series) a new
  folder, as a rerun takes;
* a torchrun restart of ``--resume PATH``: the folder the first attempt took (``RunSeries.taken_last``), from its
  newest checkpoint (PATH again would throw away that attempt's progress), and from PATH only while that folder holds
  none.

The lock: global rank 0 holds ``fcntl.flock`` on ``.lock`` in the folder for the whole run (the kernel releases it
when the process dies, so ``kill -9`` never leaves a stale lock), and a second process never continues or writes a
locked folder. Leftover temporary files are removed only under the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from utils.checkpoint.files import load_resume_checkpoint, write_failure_message
from utils.checkpoint.format import TrainingState, TrainPosition
from utils.errors import CheckpointError, ConfigError
from utils.launch.process_group import DistributedContext, decide_on_main
from utils.training.config import RESUME_AUTO

logger = logging.getLogger(__name__)

_EPOCH_PATTERN = re.compile(r"^checkpoint_epoch(\d+)\.pth$")
# Names of files being written: ``.<final name>.<random>.tmp`` beside the final name (``utils.checkpoint.files``). A
# crash can leave one behind (never under a final name); ``RunFolder.lock`` clears them under the folder's lock.
PARTIAL_FILE_PATTERN = re.compile(r"^\..+\.pth\.[A-Za-z0-9_]+\.tmp$")


def series_name(exp_name: str, fold: int | None) -> str:
    """The name of a run's folder series: ``<exp_name>``, or ``<exp_name>-fold<K>`` for fold K of --folds."""
    return exp_name if fold is None else f"{exp_name}-fold{fold}"


class RunFolder:
    """Paths, listing, resume choice, pruning and clean-up of one run folder."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.last = self.path / "last.pth"
        self.best = self.path / "best.pth"
        self.interrupted = self.path / "INTERRUPTED.pth"
        self.metrics = self.path / "metrics.jsonl"
        self.curves = self.path / "curves.png"
        self.split = self.path / "split.json"
        """``split.json``: the run's train and validation ids (``utils.datasets.splits``)."""
        self.config_file = self.path / "config.yaml"
        """``config.yaml``: the run's resolved flags, for ``--config``."""
        self.tensorboard = self.path / "tensorboard"
        """``tensorboard/``: the folder of ``--tensorboard``'s event files."""
        self.compile_cache = self.path / "compile-cache"
        """``compile-cache/``: --compile's compiled code, reused by a resumed run (``utils.training.compiled``)."""
        self.lock_file = self.path / ".lock"
        self._lock_fd: int | None = None

    def __str__(self) -> str:
        return str(self.path)

    def ranked_best(self, place: int) -> Path:
        return self.path / f"best-{place}.pth"

    def make_room_for_best(self, place: int, keep: int) -> None:
        """Move ``best-<place>.pth`` .. ``best-<keep-1>.pth`` one place down (the old ``best-<keep>.pth`` goes), so
        a new state can be written at ``place``. Each move is one atomic rename."""
        for lower in range(keep - 1, place - 1, -1):
            source = self.ranked_best(lower)
            if source.exists():
                os.replace(source, self.ranked_best(lower + 1))

    def epoch_checkpoint(self, epoch_number: int) -> Path:
        return self.path / f"checkpoint_epoch{epoch_number}.pth"

    # --------------------------------------------------------------------------------------------------- lock

    def lock(self, *, in_use_is_an_error: bool = True) -> bool:
        """Take the folder's lock (creating the folder), then remove what writes killed mid-way left there: True. When
        another process holds it: one line naming that process and the fix, or False without ``in_use_is_an_error``.

        A full disk or a folder without write permission is the same one-line error as a failed save. Leftovers are
        removed only under the lock: the temporary files of a write in progress look the same.
        """
        self.check_creatable()
        fd = None
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # EWOULDBLOCK: another process holds it
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()  # the PID its holder wrote
                os.close(fd)
                if not in_use_is_an_error:
                    return False
                pid = f" (PID {holder})" if holder.isdecimal() and int(holder) > 0 else ""
                raise ConfigError(
                    f"run folder {self.path} is in use by another training process{pid}; wait for that run to end or "
                    f"stop it, or choose another --exp_name"
                ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            os.fsync(fd)
        except OSError as error:
            if fd is not None:
                os.close(fd)
            raise CheckpointError(write_failure_message(self.lock_file, error)) from error
        self._lock_fd = fd
        for leftover in self._files(PARTIAL_FILE_PATTERN.match):
            leftover.unlink(missing_ok=True)
            logger.info("Removed %s, left behind by a checkpoint write that was interrupted", leftover)
        return True

    def unlock(self) -> None:
        if self._lock_fd is not None:
            # Unlock explicitly: forked children (DataLoader workers) share the lock and may outlive this close.
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def holds_a_run(self) -> bool:
        """Whether an earlier run wrote this folder: checkpoints or metrics (a live one holds its lock too)."""
        return bool(self.checkpoint_files()) or self.metrics.exists()

    def check_creatable(self) -> None:
        """A run folder that cannot exist (a file in its way) stops the run at its lock, in one line that says so."""
        existing = next(folder for folder in (self.path, *self.path.parents) if folder.exists())
        if not existing.is_dir():
            raise ConfigError(
                f"the run folder {self.path} cannot be created: {existing} is a file, not a folder; choose another "
                f"--checkpoint-dir (or --exp_name)"
            )

    def checkpoint_files(self) -> list[Path]:
        """Full-state checkpoints of the run folder (what a resume can take; best.pth is weights-only), unordered.

        Cheap: no file is read.
        """
        names = {self.last.name, self.interrupted.name}
        return self._files(lambda name: name in names or _EPOCH_PATTERN.match(name))

    def _files(self, wanted: Callable[[str], Any]) -> list[Path]:
        """The files of the folder whose names ``wanted`` accepts (none when the folder does not exist)."""
        if not self.path.is_dir():
            return []
        return [path for path in self.path.iterdir() if path.is_file() and wanted(path.name)]

    def find_resume_checkpoint(self) -> tuple[Path, TrainingState] | None:
        """The complete checkpoint of the furthest recorded position (``recorded_position``) and its state, None when
        there is none.

        Files whose position cannot be read (corrupt, truncated, code-bearing) are tried first: their full read names
        what is wrong with each before skipping it with a warning, so a damaged newest state is never passed over in
        silence; if there are only such files, that is an error rather than a fresh start that would overwrite them. A
        tie goes to the most recently written.
        """
        ranked = [(recorded_position(path), path.stat().st_mtime_ns, path) for path in self.checkpoint_files()]
        ranked.sort(key=lambda entry: (entry[0] is None, entry[0] or (), entry[1]), reverse=True)
        candidates = [path for _, _, path in ranked]
        for path in candidates:
            try:
                return path, load_resume_checkpoint(path)
            except CheckpointError as error:
                logger.warning("skipping %s, looking for the newest usable checkpoint of its folder: %s", path, error)
        if candidates:
            raise CheckpointError(
                f"no usable checkpoint in run folder {self.path} (all are corrupt or incomplete, see above); "
                f"pass a checkpoint with --resume PATH, or move the folder away to start a new run"
            )
        return None

    def can_continue_from(self, state: TrainingState) -> bool:
        """Whether a run resumed from ``state`` (read from a file of this folder) may write here.

        Only when nothing newer would be overwritten: the folder holds no run, or no checkpoint of it records a further
        position than ``state`` (``recorded_position``). The states of one folder are one line of history (a resume
        from an older state writes to a new folder), so one position is one state, whichever names hold it: the
        names one save writes (``last.pth``, ``checkpoint_epoch{N}.pth``) are copies of one file's bytes, and an
        ``INTERRUPTED.pth`` saved at the step ``last.pth`` holds has its tensors. Every doubt (only unreadable
        checkpoints, a run that saved nothing yet, a further file that fails its digests) answers False: the resume
        then writes to a new folder instead.
        """
        if not self.holds_a_run():
            return True
        recorded = [position for position in map(recorded_position, self.checkpoint_files()) if position is not None]
        return bool(recorded) and max(recorded) <= _position(state.position)

    def take_if(self, may_write: Callable[[RunFolder], bool], *, in_use_is_an_error: bool = False) -> bool:
        """Lock this folder when ``may_write(self)``, asked again under the lock (another run may have saved or ended
        in between); else False (a first no leaves the folder untouched, its lock file too).

        A folder a live process holds is passed over (False), or with ``in_use_is_an_error`` refused in one line that
        names that process.
        """
        if not may_write(self) or not self.lock(in_use_is_an_error=in_use_is_an_error):
            return False
        if may_write(self):
            return True
        self.unlock()
        return False

    def prune_epoch_checkpoints(self, keep_last: int) -> list[Path]:
        """Delete all but the newest ``keep_last`` checkpoint_epoch files (by epoch number); returns those deleted."""
        if keep_last <= 0:
            return []
        numbered = sorted(
            (int(_EPOCH_PATTERN.match(path.name).group(1)), path) for path in self._files(_EPOCH_PATTERN.match)
        )
        doomed = [path for _, path in numbered[:-keep_last]]
        for path in doomed:
            path.unlink(missing_ok=True)
        return doomed


class RunSeries:
    """The run folders of one ``--exp_name``: ``<exp_name>``, ``<exp_name>-2``, ... (see the module docstring)."""

    def __init__(self, checkpoint_dir: str | Path, exp_name: str) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        self.exp_name = exp_name

    def folder(self, number: int) -> RunFolder:
        name = self.exp_name if number == 1 else f"{self.exp_name}-{number}"
        return RunFolder(self.checkpoint_dir / name)

    def newest_number(self) -> int:
        """Number of the newest existing folder of the series (1 when none exists)."""
        if not self.checkpoint_dir.is_dir():
            return 1
        numbered = re.compile(rf"{re.escape(self.exp_name)}-([2-9]|[1-9]\d+)")  # <exp_name>-2, <exp_name>-3, ...
        matches = (numbered.fullmatch(entry.name) for entry in self.checkpoint_dir.iterdir() if entry.is_dir())
        return max([1, *(int(match.group(1)) for match in matches if match)])

    def newest(self) -> RunFolder:
        return self.folder(self.newest_number())

    def contains(self, path: Path) -> RunFolder | None:
        """The folder of the series that ``path`` (a checkpoint) lies in, if any."""
        parent = path.resolve().parent
        folders = (self.folder(number) for number in range(1, self.newest_number() + 1))
        return next((folder for folder in folders if folder.path.resolve() == parent), None)

    def taken_last(self, candidates: list[RunFolder]) -> RunFolder | None:
        """Of ``candidates``, the folder whose lock a process took most recently; None when none was ever taken.

        A torchrun restart finds the folder its first attempt took this way: that attempt's rank 0 took the lock
        moments before it failed, after any earlier run took the lock of any folder of the series.
        """
        taken = {}  # when a process last took each folder's lock (``lock`` writes its PID then)
        for folder in candidates:
            with contextlib.suppress(OSError):  # no lock file: never taken
                taken[folder] = folder.lock_file.stat().st_mtime_ns
        return max(taken, key=taken.__getitem__, default=None)

    def start_new(self, reason: str | None = None) -> RunFolder:
        """The newest folder if it holds no run, else the next number; locked by this process.

        Logs one line saying where the run writes and why: ``reason`` when given, else that the folder before holds
        an earlier run (nothing when the run writes to the first folder).
        """
        number = self.newest_number()
        folder = self.folder(number)
        while not folder.take_if(lambda candidate: not candidate.holds_a_run()):
            number += 1
            folder = self.folder(number)
        if reason is not None:
            logger.info("%s; this run writes to %s", reason, folder)
        elif number > 1:
            logger.info(
                "Run folder %s holds an earlier run (continue that with --resume auto); this run writes to %s",
                self.folder(number - 1),
                folder,
            )
        return folder


def _position(position: TrainPosition) -> tuple[int, int, int]:
    """(global step, epoch, step in the epoch), the order of the ranking."""
    return position.global_step, position.epoch, position.step_in_epoch


def recorded_position(path: Path) -> tuple[int, int, int] | None:
    """The position (``_position``) recorded in checkpoint ``path``; None when it cannot be read.

    Memory-mapped: only the small pickle is read, not the tensors, so ranking a folder costs little even with large
    checkpoints. The full read (digests included) happens when the file is chosen.
    """
    try:
        return _position(TrainPosition.of(torch.load(path, map_location="cpu", weights_only=True, mmap=True)))
    except Exception:  # any unreadable file ranks last; its full read names what is wrong with it
        return None


@dataclass
class RunChoice:
    """The run folder (locked on global rank 0) and the checkpoint to resume (None: a new run)."""

    folder: RunFolder
    resume_path: str | None = None
    state: TrainingState | None = None
    """The resume checkpoint's state as rank 0 read and checked it while choosing (kept to spare reading a large file
    twice); None on other ranks, which read it themselves."""


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
        return RunChoice(series.start_new())
    if resume is None or resume == RESUME_AUTO:
        folder = series.newest()
    else:
        # A restart continues the folder its first attempt took: the one PATH lies in, or the series' newest.
        candidates = [folder for folder in (series.contains(Path(resume)), series.newest()) if folder is not None]
        folder = series.taken_last(candidates) if restart_count > 0 else None
        if folder is None:  # a first attempt (or one whose first attempt failed before it chose)
            return _resume_from_path(resume, series)
    folder.lock()
    found = folder.find_resume_checkpoint()
    if found is not None:
        path, state = found
        if restart_count > 0:
            logger.info("torchrun restart %d continues %s, from its newest checkpoint %s", restart_count, folder, path)
        return RunChoice(folder, str(path), state)
    if resume is None or resume == RESUME_AUTO:
        logger.info("--resume auto: no checkpoint in %s yet, starting a new run", folder)
        return RunChoice(folder)
    logger.info("torchrun restart %d: no checkpoint in %s yet, resuming --resume %s", restart_count, folder, resume)
    return RunChoice(folder, resume, load_resume_checkpoint(resume))


def _resume_from_path(resume: str, series: RunSeries) -> RunChoice:
    """A first attempt's --resume PATH: the folder PATH lies in when PATH holds its newest state, else a new one."""
    state = load_resume_checkpoint(resume)
    own = series.contains(Path(resume))
    if own is None:  # a file from outside the series: nothing of the series to continue
        return RunChoice(series.start_new(), resume, state)
    # Asked before the lock too: a folder it may not continue is left untouched, and a live run's is refused.
    if own.take_if(lambda folder: folder.can_continue_from(state), in_use_is_an_error=True):
        return RunChoice(own, resume, state)
    reason = f"--resume {resume} is not the newest state of {own} (continuing there would overwrite newer checkpoints)"
    return RunChoice(series.start_new(reason), resume, state)
