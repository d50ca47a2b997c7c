"""A cache of decoded, resized pixels: each image and mask decoded and resized once, then memory-mapped.

A full-size Carvana item (1918x1280 JPEG + GIF mask, resized to 959x640) costs one loader worker 55-77 ms; read from
this cache it costs a few milliseconds, so a few cores can feed a GPU. Files are ``.npy`` arrays named by a hash of
what decides their pixels: the source file's absolute path, size, modification and change times and inode, the scale,
the model's input channels, the kind (image or mask) and ``PIXEL_CACHE_VERSION``. A changed source file therefore gets
a new entry (even when its modification time was put back: its change time moved); old
entries are never read again (delete the folder to reclaim the space).

Images are stored as the uint8 ``[H, W, C]`` array the network input is made from (16-bit and float images are not
cached: uint8 would lose their precision), masks as their resized raw values (uint8 for palette and grey masks), so
the class mapping and augmentation run on the cached arrays exactly as on freshly decoded ones, and batches are
bit-identical with and without the cache.

Entries are written lazily by whichever process loads an item first (the loader workers of the first epoch), each
atomically (temp file, then ``os.replace``), so two ranks writing the same entry or a run killed mid-write never leave
a half file under an entry's name. A write that fails (full disk, read-only folder) turns writing off for that
process and, through a marker file, for its sibling loader workers, with one warning; loading carries on uncached.

Fill it up front, in parallel::

    python -m utils.datasets.pixel_cache build-cache --imgs data/imgs --masks data/masks --scale 0.5 --cache DIR

(the command lives in ``__main__.py`` beside this file, so this library imports no dataset).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from utils.datasets.image_files import FileInfo, cache_key
from utils.errors import ConfigError
from utils.output_files import OutputError, replacing

logger = logging.getLogger(__name__)

# Part of every entry's name: bump it whenever decoding, resizing or the stored layout changes.
PIXEL_CACHE_VERSION = 2  # 2: EXIF orientation applied
IMAGE, MASK = "image", "mask"


class PixelCache:
    """The entries of one dataset configuration (scale, channels) in ``directory``.

    ``read`` returns a read-only memory-mapped array or ``None``; ``write`` stores one, or warns once and stops
    writing if it cannot.
    """

    def __init__(self, directory: str | Path, *, scale: float, channels: int) -> None:
        self.directory = os.path.abspath(directory)
        self.settings = (PIXEL_CACHE_VERSION, scale, channels)
        # Made by the process that built the dataset, whose loader workers (forked copies) share it: the first of them
        # whose write fails creates it and warns, and the others stop writing without a warning of their own.
        self._failure_marker = os.path.join(self.directory, f".writes-failed-{os.getpid()}")
        self._writing = True

    def check_outside(self, *folders: str | Path) -> None:
        """Refuse a cache folder inside a data folder: its files would mix with (or be indexed as) the data."""
        for folder in map(os.path.abspath, folders):
            if os.path.commonpath([folder, self.directory]) == folder:
                raise ConfigError(
                    f"the pixel cache {self.directory} is inside the data folder {folder}; choose a folder outside "
                    "the image and mask folders (e.g. --pixel-cache ~/.cache/unet-ddp/pixels)"
                )

    def entry_path(self, info: FileInfo, kind: str) -> str:
        return os.path.join(self.directory, f"{cache_key([info], kind, *self.settings)}.npy")

    def read(self, info: FileInfo, kind: str) -> np.ndarray | None:
        try:
            return np.load(self.entry_path(info, kind), mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError):
            # No entry yet (FileNotFoundError), or a damaged one: written atomically, so that comes from outside (e.g.
            # a power cut before the data reached the disk). Decode the source again; the write replaces the entry.
            return None

    def write(self, info: FileInfo, kind: str, array: np.ndarray) -> None:
        if not self._writing or os.path.exists(self._failure_marker):
            self._writing = False
            return
        try:
            # Not durable: a killed process cannot leave a half entry (the rename is atomic), and an entry damaged by
            # a power cut only costs a re-decode (see read). Syncing every entry would slow the first epoch.
            with replacing(Path(self.entry_path(info, kind)), durable=False) as temporary:
                np.save(temporary, np.ascontiguousarray(array), allow_pickle=False)  # its name ends in .npy
        except OutputError as err:
            self._writing = False
            try:
                # O_EXCL: of the loader workers that fail, only the first creates the marker and warns.
                os.close(os.open(self._failure_marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return
            except OSError:
                pass  # cannot even create an empty file: warn anyway
            logger.warning(
                "Cannot write the pixel cache %s (%s); loading continues without caching new items (free space or "
                "choose another --pixel-cache folder to cache them)",
                self.directory,
                err.__cause__.strerror or err.__cause__,
            )


def cached(cache: PixelCache | None, info: FileInfo, kind: str, decode: Callable[[], np.ndarray]) -> np.ndarray:
    """``info``'s entry in ``cache`` (read-only, memory-mapped), else ``decode()``'s array, stored in ``cache`` for the
    next read: a mask always, an image only as uint8 (16-bit and float pixels are not cached)."""
    stored = cache.read(info, kind) if cache is not None else None
    if stored is not None:
        return stored
    array = decode()
    if cache is not None and (kind == MASK or array.dtype == np.uint8):
        cache.write(info, kind, array)
    return array
