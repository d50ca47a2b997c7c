"""Segmentation datasets over a folder of images and a folder of masks (milesial/Pytorch-UNet compatible).

``dataset[i]`` is ``{"image": float32 [C, H, W] in [0, 1], "mask": int64 [H, W] in 0..K-1}``. Mask value
``dataset.mask_values[k]`` becomes class ``k``. All checks that need the whole dataset (pairing, sizes, mask values)
run once at construction, so bad data fails before training starts, with one message naming the files.

The image preparation (``image_tensor``, ``resized_image``: conversion and resizing by ``scale``) is shared with
inference, so a model sees at inference exactly the pixels it was trained on; so is the pixel cache (``PixelCache``)
that keeps its results, which ``python -m utils.datasets.pixel_cache build-cache`` fills up front.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import Dataset

from utils.datasets.augmentation import JointAugmentation
from utils.datasets.image_files import (
    CARVANA_MASK_SUFFIX,
    UNREADABLE_FILE_ERRORS,
    FileInfo,
    Finding,
    cache_key,
    format_examples,
    load_image,
    mode_channels,
    pair_folders,
)
from utils.datasets.mask_values import (
    MaskScan,
    MaskValues,
    class_totals,
    class_value_findings,
    mask_array,
    scan_masks,
    values_to_classes,
)
from utils.errors import ConfigError, DatasetError
from utils.output_files import OutputError, replacing

logger = logging.getLogger(__name__)

# Part of every pixel-cache entry's name: bump it whenever decoding, resizing or the stored layout changes.
PIXEL_CACHE_VERSION = 2  # 2: EXIF orientation applied
IMAGE, MASK = "image", "mask"


class BasicDataset(Dataset):
    """Images ``<images_dir>/<id>.<ext>`` with masks ``<mask_dir>/<id><mask_suffix>.<ext>``.

    Args:
        images_dir: folder of images (any of ``IMAGE_EXTENSIONS``, any letter case; hidden files and sub-folders
            are ignored). Colour images load as RGB (alpha dropped), grey ones as one channel; see ``channels``.
        mask_dir: folder of masks: palette images (their indices are the values, as Carvana's GIFs), grey images,
            16/32-bit grey label maps, RGB colour-coded images, or ``.npy``/``.pt`` arrays.
        scale: resize factor in (0, 1]; images use bicubic and masks nearest-neighbour interpolation.
        mask_suffix: text between the image id and the mask's extension (``"_mask"`` for Carvana); ``None``
            detects it from the file names (as ``detect_mask_suffix``, without indexing the folders twice).
        n_classes: if given, more distinct mask values than the model can predict is an error (``1`` means binary
            with one logit, which allows two values).
        cache_dir: where the mask-value cache lives (default ``utils.datasets.mask_values.default_cache_dir()``).
        scan_workers: processes for the first mask scan (default ``min(cpu count, 8)``).
        channels: the model's input channels, 1 or 3; photos of the other kind are converted (grey to RGB or RGB to
            grey) with one warning counting them. ``None``: the kind most images have (RGB on a tie).
        pixel_cache_dir: a folder (outside the data folders) for decoded, resized uint8 pixels, filled as items load
            and memory-mapped afterwards (``PixelCache``); items are identical with or without it.
        ignore_values: void mask values (e.g. 255 for VOC/Cityscapes borders; single-channel masks only): left out of
            ``mask_values`` and of the class count, their pixels become ``IGNORE_INDEX`` in ``dataset[i]["mask"]``.
    """

    def __init__(
        self,
        images_dir: str | Path,
        mask_dir: str | Path,
        scale: float = 1.0,
        mask_suffix: str | None = "",
        *,
        n_classes: int | None = None,
        cache_dir: str | Path | None = None,
        scan_workers: int | None = None,
        channels: int | None = None,
        pixel_cache_dir: str | Path | None = None,
        ignore_values: Iterable[int] = (),
    ) -> None:
        if not 0 < scale <= 1:
            raise ConfigError(f"scale must be in (0, 1], got {scale}; pass a value such as --scale 0.5")
        if n_classes is not None and n_classes < 1:
            raise ConfigError(f"n_classes must be at least 1, got {n_classes}; pass --classes 1 for binary masks")
        if scan_workers is not None and scan_workers < 1:
            raise ConfigError(f"scan_workers must be at least 1, got {scan_workers}")
        if channels not in (None, 1, 3):
            raise ConfigError(f"channels must be 1 (grey) or 3 (RGB), got {channels}")
        self.images_dir = Path(images_dir)
        self.mask_dir = Path(mask_dir)
        self.scale = scale

        # Tens of thousands of small objects (one per file) trigger full garbage collections that walk every object
        # of the process (torch has many): pausing the collector halves a second start over 10,000 pairs.
        with _gc_paused():
            pairing = pair_folders(self.images_dir, self.mask_dir, mask_suffix)
            self.mask_suffix = pairing.mask_suffix
            _raise_problems(pairing.problems, pairing.warnings)
            scan = scan_masks(pairing.pairs, cache_dir=cache_dir, workers=scan_workers)
            _raise_problems(scan.problems, [], f"bad data in {self.mask_dir} / {self.images_dir}: ")
            self.ignore_values: list[int] = sorted(set(ignore_values))
            # Per image, pixels of each class; void pixels counted apart.
            self.mask_values, self._class_counts, self.void_pixels = scan.classes(self.ignore_values)
            problems, warnings = class_value_findings(
                self.mask_values, pairing.pairs, self.mask_dir, n_classes, self.ignore_values
            )
            too_small = sorted(
                f"{pairing.images[name].name} ({row.image_size[0]}x{row.image_size[1]})"
                for name, row in scan.pairs.items()
                if min(row.image_size) * scale < 1  # scaled_size's rule (int(scale * side) == 0), for every image
            )
            if too_small:
                what = f"scale {scale} shrinks {len(too_small)} image(s) to zero pixels"
                problems.append(Finding("sizes", what, tuple(too_small), "use a larger --scale or remove those images"))
            _raise_problems(problems, warnings)

            self.ids: list[str] = sorted(pairing.images)
            self.channels: int = _choose_channels(scan, channels, pairing.images, self.images_dir)
            self._files = {pair.name: (pair.image, pair.mask) for pair in pairing.pairs}
            self._augmentation: JointAugmentation | None = None
            self._epoch = 0
            self.pixel_cache: PixelCache | None = None
            if pixel_cache_dir is not None:
                self.pixel_cache = PixelCache(pixel_cache_dir, scale=scale, channels=self.channels)
                self.pixel_cache.check_outside(self.images_dir, self.mask_dir)
        logger.info("Creating dataset with %d examples", len(self.ids))
        logger.info("Unique mask values: %s", self.mask_values)
        if self.ignore_values:
            total = sum(self.class_pixel_counts()) + self.void_pixels
            void = f"{self.void_pixels} of {total} mask pixels ({100 * self.void_pixels / max(total, 1):.2f}%)"
            values = ", ".join(map(str, self.ignore_values))
            logger.info("%s are void (mask value(s) %s): left out of the loss and the metrics", void, values)

    def class_pixel_counts(self, indices: Iterable[int] | None = None) -> list[int]:
        """Pixels of each class (void excluded) over the items ``indices`` (all by default), from the mask scan."""
        chosen = range(len(self.ids)) if indices is None else indices
        return class_totals((self._class_counts.get(self.ids[index], {}) for index in chosen), len(self.mask_values))

    def has_foreground(self, index: int) -> bool:
        """Whether item ``index``'s mask holds a class other than class 0 (background), from the mask scan."""
        return any(k > 0 for k in self._class_counts.get(self.ids[index], {}))

    def __len__(self) -> int:
        return len(self.ids)

    def with_augmentation(self, seed: int) -> BasicDataset:
        """The same files with ``JointAugmentation`` on, without a second scan (this dataset stays unaugmented);
        ``seed`` with ``set_epoch`` and the sample index fixes each sample's augmentation."""
        twin = copy.copy(self)
        twin._augmentation = JointAugmentation(seed)
        return twin

    def set_epoch(self, epoch: int) -> None:
        """Select the augmentation of ``epoch``.

        DataLoader workers hold copies of the dataset made when iteration starts, so call this before creating the
        epoch's iterator, and do not use ``persistent_workers=True`` with augmentation (the workers would keep the
        old epoch).
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self._epoch = epoch

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = range(len(self.ids))[index]  # from the end when negative: the augmentation is seeded by this index
        image_info, mask_info, pixels, raw_mask = self._pixels(index)
        if pixels.shape[1:] != raw_mask.shape[:2]:
            raise DatasetError(
                f"{mask_info.path} and {image_info.path} differ in size ({raw_mask.shape[1]}x{raw_mask.shape[0]} vs "
                f"{pixels.shape[2]}x{pixels.shape[1]}): a file changed after the dataset was built; fix it and restart"
            )
        if self._augmentation is not None:
            # On the uint8 pixels and the raw mask values (cached or not): the crop is cut before anything is
            # converted, and gathering 8-bit mask values before the class mapping moves an eighth of the bytes.
            raw = np.array(raw_mask, dtype=np.int32 if raw_mask.dtype == np.uint16 else None)  # torch lacks uint16 ops
            pixels, moved = self._augmentation(pixels, torch.from_numpy(raw), epoch=self._epoch, index=index)
            raw_mask = moved.numpy()
        mask = torch.from_numpy(values_to_classes(raw_mask, self.mask_values, mask_info.path, self.ignore_values))
        return {"image": unit_float(pixels), "mask": mask}

    def fill_pixel_cache(self, index: int) -> None:
        """Make sure item ``index``'s pixels are in the pixel cache (``build-cache`` runs this for every item)."""
        self._pixels(index)

    def _pixels(self, index: int) -> tuple[FileInfo, FileInfo, torch.Tensor, np.ndarray]:
        """Item ``index``'s image and mask files, through the pixel cache: the resized image, [C, H, W] (uint8, or
        float32 in [0, 1] for 16-bit and float images), and the resized mask's raw values (``mask_array`` sampled to
        the network's size, before the class mapping)."""
        image_info, mask_info = self._files[self.ids[index]]
        decode_image = functools.partial(_decode, image_info.path, resized_image, self.scale, self.channels)
        decode_mask = functools.partial(_decode, mask_info.path, resized_mask, self.scale)
        pixels = cached_image(self.pixel_cache, image_info, decode_image)
        return image_info, mask_info, pixels, cached(self.pixel_cache, mask_info, MASK, decode_mask)

    @staticmethod
    def preprocess(mask_values: MaskValues, pil_img: Image.Image, scale: float, is_mask: bool) -> np.ndarray:
        """Resize by ``scale`` and convert, as milesial's ``BasicDataset.preprocess``.

        Images become float32 CxHxW in [0, 1] (grey images 1xHxW), masks int64 HxW class indices.
        """
        return mask_classes(pil_img, scale, mask_values) if is_mask else image_tensor(pil_img, scale).numpy()


class CarvanaDataset(BasicDataset):
    """``BasicDataset`` with Carvana's mask names, ``<id>_mask.<ext>``."""

    def __init__(self, images_dir: str | Path, mask_dir: str | Path, scale: float = 1.0, **kwargs) -> None:
        super().__init__(images_dir, mask_dir, scale, mask_suffix=CARVANA_MASK_SUFFIX, **kwargs)


class PixelCache:
    """Decoded, resized pixels of one dataset configuration (scale, channels) in ``directory``: each image and mask
    decoded and resized once, then memory-mapped (``pixel_cache_dir=``, train.py's and predict.py's
    ``--pixel-cache``).

    A full-size Carvana item (1918x1280 JPEG + GIF mask, resized to 959x640) costs one loader worker 55-77 ms; read
    from this cache it costs a few milliseconds, so a few cores can feed a GPU. Entries are ``.npy`` arrays named by
    ``image_files.cache_key`` of what decides their pixels: the source file's record (absolute path, size,
    modification and change times, inode), the kind (image or mask), ``PIXEL_CACHE_VERSION``, the scale and the
    model's input channels. A changed source file therefore gets a new entry (even when its modification time was
    put back: its change time moved); old entries are never read again (delete the folder to reclaim the space).

    Images are stored as the uint8 ``[H, W, C]`` array the network input is made from (16-bit and float images are
    not cached: uint8 would lose their precision), masks as their resized raw values (uint8 for palette and grey
    masks), so the class mapping and augmentation run on the cached arrays exactly as on freshly decoded ones, and
    batches are bit-identical with and without the cache.

    Entries are written lazily by whichever process loads an item first (the loader workers of the first epoch),
    each atomically (temp file, then ``os.replace``), so two ranks writing the same entry or a run killed mid-write
    never leave a half file under an entry's name. A write that fails (full disk, read-only folder) turns writing
    off for that process and, through a marker file, for its sibling loader workers, with one warning; loading
    carries on uncached. ``python -m utils.datasets.pixel_cache build-cache`` fills it up front, in parallel.

    ``cached`` reads an entry (memory-mapped) or decodes and writes it; ``write`` warns once and stops writing if it
    cannot.
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

    def write(self, info: FileInfo, kind: str, array: np.ndarray) -> None:
        if not self._writing or os.path.exists(self._failure_marker):
            self._writing = False
            return
        try:
            # Not durable: a killed process cannot leave a half entry (the rename is atomic), and an entry damaged by
            # a power cut only costs a re-decode (see cached). Syncing every entry would slow the first epoch.
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
    if cache is not None:
        # No entry yet (FileNotFoundError), or a damaged one: written atomically, so that comes from outside (e.g. a
        # power cut before the data reached the disk). Decode the source again; the write replaces the entry.
        with contextlib.suppress(OSError, ValueError, EOFError):
            return np.load(cache.entry_path(info, kind), mmap_mode="r", allow_pickle=False)
    array = decode()
    if cache is not None and (kind == MASK or array.dtype == np.uint8):
        cache.write(info, kind, array)
    return array


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _decode(path: str, convert: Callable[..., object], *settings: object) -> object:
    """Open ``path`` and ``convert(image, *settings)``, turning decoding failures into a ``DatasetError`` that names
    the file (our own ``DatasetError``s, not among ``UNREADABLE_FILE_ERRORS``, pass as they are)."""
    try:
        with load_image(path) as img:
            return convert(img, *settings)
    except UNREADABLE_FILE_ERRORS as err:
        raise DatasetError(f"cannot decode {path} ({err}); replace or delete the file") from err


def _choose_channels(scan: MaskScan, requested: int | None, images: dict[str, FileInfo], images_dir: Path) -> int:
    """The model's input channels; warns once, with a count, about the photos that will be converted."""
    counts = Counter(row.image_channels for row in scan.pairs.values())
    channels = requested or (1 if counts[1] > counts[3] else 3)
    converted = sorted(images[name].name for name, row in scan.pairs.items() if row.image_channels != channels)
    if converted:
        kind, target = ("grey", "RGB") if channels == 3 else ("colour", "grey")
        what = f"{len(converted)} of {len(scan.pairs)} images in {images_dir} are {kind} and are converted to"
        logger.warning("%s %s for a %d-channel model: %s", what, target, channels, format_examples(converted))
    return channels


def _raise_problems(problems: Sequence[Finding], warnings: Sequence[Finding], where: str = "") -> None:
    """Log each warning; raise the problems as one DatasetError (after ``where``)."""
    for warning in warnings:
        logger.warning("%s", warning.sentence())
    if problems:
        raise DatasetError(where + "; ".join(problem.sentence() for problem in problems))


def cached_image(cache: PixelCache | None, info: FileInfo, decode: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``decode()``'s resized image (``resized_image``) through the pixel cache ``cache`` (``None``: no cache), as
    [C, H, W]; a stored entry comes back as a writable copy of its mapped pages. Training and predict.py read here."""
    pixels = cached(cache, info, IMAGE, lambda: decode().permute(1, 2, 0).numpy())  # stored [H, W, C]
    return torch.from_numpy(pixels if pixels.flags.writeable else np.array(pixels)).permute(2, 0, 1)


def image_tensor(img: Image.Image, scale: float, channels: int | None = None) -> torch.Tensor:
    """Return an image as float32 [C, H, W] in [0, 1], resized by ``scale`` with antialiased bicubic filtering.

    ``channels`` (1 or 3) converts grey photos to RGB or the reverse; ``None`` keeps the photo's own kind.
    """
    return unit_float(resized_image(img, scale, channels))


def resized_image(img: Image.Image, scale: float, channels: int | None = None) -> torch.Tensor:
    """The image resized by ``scale`` as [C, H, W]: uint8, or float32 in [0, 1] for 16-bit and float images.

    Resized exactly as torchvision's ``transforms.v2.functional.resize(..., BICUBIC, antialias=True)``, which runs
    the same ``interpolate`` call: called directly because importing torchvision imports ``torch._dynamo`` (through
    ``torchvision.ops``), seconds added to every start. Resizing runs on the uint8 tensor: the uint8 kernel is about
    3x faster than PIL and agrees with it to within one grey level. The result is a view of [H, W, C] memory
    (channels last, as decoded and as the pixel cache stores it): the augmentation's crop-and-resize runs fastest on
    that layout, and the conversion to float returns to [C, H, W] in the same pass.
    """
    # [1, C, H, W] over the decoded [H, W, C] memory. torch's [None] gives the batch axis the whole size as its stride
    # (numpy's gives 0), as torchvision restrides it (pytorch/pytorch#68430): interpolate then writes channels-last
    # without a repacking copy, twice as fast on uint8.
    image = torch.from_numpy(_image_array(img, channels))[None].permute(0, 3, 1, 2)
    height, width = image.shape[2:]
    new_width, new_height = scaled_size(width, height, scale)
    if (new_width, new_height) != (width, height):
        image = F.interpolate(image, size=[new_height, new_width], mode="bicubic", align_corners=False, antialias=True)
    if image.dtype != torch.uint8:
        # Bicubic filtering overshoots at edges; float images must stay within [0, 1].
        image = image.clamp(0.0, 1.0)
    return image[0].permute(1, 2, 0).contiguous().permute(2, 0, 1)


def mask_classes(img: Image.Image, scale: float, mask_values: MaskValues) -> np.ndarray:
    """Return a mask as int64 [H, W] class indices, resized by ``scale`` with nearest-neighbour sampling."""
    return values_to_classes(resized_mask(img, scale), mask_values)


def resized_mask(img: Image.Image, scale: float) -> np.ndarray:
    """A mask's raw values (``mask_array``) resized by ``scale`` with nearest-neighbour sampling."""
    mask = mask_array(img)
    height, width = mask.shape[:2]
    new_width, new_height = scaled_size(width, height, scale)
    if (new_width, new_height) != (width, height):
        # Same sample points as PIL's NEAREST (pixel centres), but works for every dtype and channel count.
        rows = np.minimum(((np.arange(new_height) + 0.5) * height / new_height).astype(np.intp), height - 1)
        cols = np.minimum(((np.arange(new_width) + 0.5) * width / new_width).astype(np.intp), width - 1)
        mask = mask[rows[:, None], cols[None, :]]
    return mask


def unit_float(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 pixels as float32 in [0, 1] (float pixels pass through as float32)."""
    floats = pixels.to(torch.float32, memory_format=torch.contiguous_format)
    return floats.div_(255) if pixels.dtype == torch.uint8 else floats


def scaled_size(width: int, height: int, scale: float) -> tuple[int, int]:
    """Return ``(int(scale * width), int(scale * height))``, as milesial; a zero side is an error."""
    new_width, new_height = int(scale * width), int(scale * height)
    if new_width <= 0 or new_height <= 0:
        raise DatasetError(f"scale {scale} shrinks a {width}x{height} image to nothing; use a larger --scale")
    return new_width, new_height


def _image_array(img: Image.Image, channels: int | None = None) -> np.ndarray:
    """Return HxWxC pixels: uint8, or float32 in [0, 1] for 16-bit and float images.

    ``channels`` converts by mode: a grey photo (any grey mode) to RGB, a colour one (RGB, RGBA, palette, CMYK, ...)
    to grey, as ``PIL.Image.convert`` does.
    """
    mode = img.mode
    if channels == 3 and mode_channels(mode) == 1:
        return np.repeat(_image_array(img), 3, axis=2)
    if channels == 1 and mode_channels(mode) == 3:
        img, mode = img.convert("L"), "L"
    if mode == "F" or mode == "I" or mode.startswith("I;16"):
        # 16-bit grey (PNG opens as "I;16" or "I" depending on the Pillow version): full range is 0..65535.
        array = np.clip(np.array(img, dtype=np.float32) / (1.0 if mode == "F" else 65535.0), 0.0, 1.0)
    elif mode in ("L", "RGB"):
        array = np.array(img)  # a writable copy: torch.from_numpy warns on PIL's read-only buffers
    else:
        array = np.array(img.convert("L" if mode in ("1", "LA") else "RGB"))
    return array[:, :, None] if array.ndim == 2 else array
