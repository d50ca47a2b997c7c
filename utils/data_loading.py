"""Segmentation datasets over a folder of images and a folder of masks (milesial/Pytorch-UNet compatible).

``dataset[i]`` is ``{"image": float32 [C, H, W] in [0, 1], "mask": int64 [H, W] in 0..K-1}``. Mask value
``dataset.mask_values[k]`` becomes class ``k``. All checks that need the whole dataset (pairing, sizes, mask values)
run once at construction, so bad data fails before training starts, with one message naming the files.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image
from torch.utils.data import Dataset

from utils.datasets.augmentation import JointAugmentation
from utils.datasets.image_files import IMAGE_EXTENSIONS, UNREADABLE_FILE_ERRORS, FileInfo, index_folder, load_image
from utils.datasets.mask_values import (
    MaskPair,
    MaskValues,
    format_examples,
    mask_array,
    scan_masks,
    values_to_classes,
)
from utils.errors import ConfigError, DatasetError

__all__ = [
    "IMAGE_EXTENSIONS",
    "BasicDataset",
    "CarvanaDataset",
    "detect_mask_suffix",
    "image_tensor",
    "load_image",
    "mask_classes",
    "scaled_size",
]

logger = logging.getLogger(__name__)

CARVANA_MASK_SUFFIX = "_mask"
JPEG_EXTENSIONS = (".jpg", ".jpeg")
_T = TypeVar("_T")


class BasicDataset(Dataset):
    """Images ``<images_dir>/<id>.<ext>`` with masks ``<mask_dir>/<id><mask_suffix>.<ext>``.

    Args:
        images_dir: folder of images (any of ``IMAGE_EXTENSIONS``, any letter case; hidden files and sub-folders
            are ignored). Colour images load as RGB (alpha dropped), grey ones as one channel.
        mask_dir: folder of masks: palette images (their indices are the values, as Carvana's GIFs), grey images,
            16/32-bit grey label maps, RGB colour-coded images, or ``.npy``/``.pt`` arrays.
        scale: resize factor in (0, 1]; images use bicubic and masks nearest-neighbour interpolation.
        mask_suffix: text between the image id and the mask's extension (``"_mask"`` for Carvana).
        n_classes: if given, more distinct mask values than the model can predict is an error (``1`` means binary
            with one logit, which allows two values).
        augment: apply ``JointAugmentation``; off by default.
        seed: augmentation seed; with ``set_epoch`` and the sample index it fixes each sample's augmentation.
        cache_dir: where the mask-value cache lives (default ``utils.datasets.mask_values.default_cache_dir()``).
        scan_workers: processes for the first mask scan (default ``min(cpu count, 8)``).
    """

    def __init__(
        self,
        images_dir: str | Path,
        mask_dir: str | Path,
        scale: float = 1.0,
        mask_suffix: str = "",
        *,
        n_classes: int | None = None,
        augment: bool = False,
        seed: int = 0,
        cache_dir: str | Path | None = None,
        scan_workers: int | None = None,
    ) -> None:
        if not 0 < scale <= 1:
            raise ConfigError(f"scale must be in (0, 1], got {scale}; pass a value such as --scale 0.5")
        if n_classes is not None and n_classes < 1:
            raise ConfigError(f"n_classes must be at least 1, got {n_classes}; pass --classes 1 for binary masks")
        if scan_workers is not None and scan_workers < 1:
            raise ConfigError(f"scan_workers must be at least 1, got {scan_workers}")
        self.images_dir = Path(images_dir)
        self.mask_dir = Path(mask_dir)
        self.scale = scale
        self.mask_suffix = mask_suffix

        images = index_folder(self.images_dir, "image")
        if not images:
            raise DatasetError(
                f"no images in {self.images_dir} (looked for {_extension_list()}; hidden files and sub-folders are "
                "ignored); put the training images there"
            )
        masks = index_folder(self.mask_dir, "mask")
        if not masks:
            raise DatasetError(
                f"no masks in {self.mask_dir} (looked for {_extension_list()}); put one mask per image there"
            )
        pairs = _pair_files(images, masks, mask_suffix, self.images_dir, self.mask_dir)
        _check_no_empty_files(pairs)
        jpeg_masks = [pair.mask.path.name for pair in pairs if pair.mask.path.suffix.lower() in JPEG_EXTENSIONS]
        if jpeg_masks:
            logger.warning(
                "%d mask(s) in %s are JPEG files (e.g. %s): JPEG compression noise creates extra mask values along "
                "edges; save masks as PNG or GIF",
                len(jpeg_masks),
                self.mask_dir,
                format_examples(jpeg_masks),
            )

        scan = scan_masks(pairs, cache_dir=cache_dir, workers=scan_workers)
        _check_value_count(scan.mask_values, n_classes, self.mask_dir, jpeg=bool(jpeg_masks))
        _check_scaled_sizes(scan.image_sizes, scale, images)

        self.ids: list[str] = sorted(images)
        self.mask_values: MaskValues = scan.mask_values
        self._image_paths = {pair.name: pair.image.path for pair in pairs}
        self._mask_paths = {pair.name: pair.mask.path for pair in pairs}
        self._augmentation = JointAugmentation(seed) if augment else None
        self._epoch = 0
        logger.info("Creating dataset with %d examples", len(self.ids))
        logger.info("Unique mask values: %s", self.mask_values)

    def __len__(self) -> int:
        return len(self.ids)

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
        index = operator.index(index)
        if index < 0:
            index += len(self.ids)
        name = self.ids[index]
        image_path, mask_path = self._image_paths[name], self._mask_paths[name]
        image = _decode(image_path, lambda img: image_tensor(img, self.scale))
        mask = _decode(mask_path, lambda img: torch.from_numpy(mask_classes(img, self.scale, self.mask_values)))
        if image.shape[1:] != mask.shape:
            raise DatasetError(
                f"{mask_path} and {image_path} differ in size ({mask.shape[1]}x{mask.shape[0]} vs "
                f"{image.shape[2]}x{image.shape[1]}): a file changed after the dataset was built; fix it and restart"
            )
        if self._augmentation is not None:
            image, mask = self._augmentation(image, mask, epoch=self._epoch, index=index)
        return {"image": image, "mask": mask}

    @staticmethod
    def preprocess(mask_values: MaskValues, pil_img: Image.Image, scale: float, is_mask: bool) -> np.ndarray:
        """Resize by ``scale`` and convert, as milesial's ``BasicDataset.preprocess``.

        Images become float32 CxHxW in [0, 1] (grey images 1xHxW), masks int64 HxW class indices.
        """
        if is_mask:
            return mask_classes(pil_img, scale, mask_values)
        return image_tensor(pil_img, scale).numpy()


class CarvanaDataset(BasicDataset):
    """``BasicDataset`` with Carvana's mask names, ``<id>_mask.<ext>``."""

    def __init__(self, images_dir: str | Path, mask_dir: str | Path, scale: float = 1.0, **kwargs) -> None:
        super().__init__(images_dir, mask_dir, scale, mask_suffix=CARVANA_MASK_SUFFIX, **kwargs)


def detect_mask_suffix(images_dir: str | Path, mask_dir: str | Path) -> str:
    """Return ``"_mask"`` if the masks are named ``<id>_mask.<ext>`` after the images, else ``""``.

    Decided by file names only: whichever naming matches more images wins, ``""`` on a tie.
    """
    image_ids = index_folder(images_dir, "image").keys()
    mask_stems = index_folder(mask_dir, "mask").keys()
    with_suffix = _count_named(image_ids, mask_stems, CARVANA_MASK_SUFFIX)
    return CARVANA_MASK_SUFFIX if with_suffix > _count_named(image_ids, mask_stems, "") else ""


def image_tensor(img: Image.Image, scale: float) -> torch.Tensor:
    """Return an image as float32 [C, H, W] in [0, 1], resized by ``scale`` with antialiased bicubic filtering.

    Resizing runs on the uint8 tensor: torchvision's uint8 path is about 3x faster than PIL's and agrees with it
    to within one grey level.
    """
    array = _image_array(img)
    tensor = torch.from_numpy(array)
    tensor = tensor.permute(2, 0, 1) if tensor.ndim == 3 else tensor[None]
    height, width = tensor.shape[1:]
    new_width, new_height = scaled_size(width, height, scale)
    if (new_width, new_height) != (width, height):
        tensor = TF.resize(tensor, [new_height, new_width], interpolation=TF.InterpolationMode.BICUBIC, antialias=True)
    if tensor.dtype == torch.uint8:
        return tensor.to(torch.float32, memory_format=torch.contiguous_format).div_(255)
    # Bicubic filtering overshoots at edges; float images must stay within [0, 1].
    return tensor.to(torch.float32, memory_format=torch.contiguous_format).clamp_(0.0, 1.0)


def mask_classes(img: Image.Image, scale: float, mask_values: MaskValues) -> np.ndarray:
    """Return a mask as int64 [H, W] class indices, resized by ``scale`` with nearest-neighbour sampling."""
    mask = mask_array(img)
    height, width = mask.shape[:2]
    new_width, new_height = scaled_size(width, height, scale)
    if (new_width, new_height) != (width, height):
        # Same sample points as PIL's NEAREST (pixel centres), but works for every dtype and channel count.
        rows = np.minimum(((np.arange(new_height) + 0.5) * height / new_height).astype(np.intp), height - 1)
        cols = np.minimum(((np.arange(new_width) + 0.5) * width / new_width).astype(np.intp), width - 1)
        mask = mask[rows[:, None], cols[None, :]]
    return values_to_classes(mask, mask_values)


def scaled_size(width: int, height: int, scale: float) -> tuple[int, int]:
    """Return ``(int(scale * width), int(scale * height))``, as milesial; a zero side is an error."""
    new_width, new_height = int(scale * width), int(scale * height)
    if new_width <= 0 or new_height <= 0:
        raise DatasetError(f"scale {scale} shrinks a {width}x{height} image to nothing; use a larger --scale")
    return new_width, new_height


def _image_array(img: Image.Image) -> np.ndarray:
    """Return HxW or HxWx3 pixels: uint8, or float32 in [0, 1] for 16-bit and float images."""
    mode = img.mode
    if mode in ("L", "RGB"):
        return np.array(img)  # a writable copy: torch.from_numpy warns on PIL's read-only buffers
    if mode in ("1", "LA"):
        return np.array(img.convert("L"))
    if mode == "F":
        return np.clip(np.array(img, dtype=np.float32), 0.0, 1.0)
    if mode == "I" or mode.startswith("I;16"):
        # 16-bit grey (PNG opens as "I;16" or "I" depending on the Pillow version): full range is 0..65535.
        return np.clip(np.array(img, dtype=np.float32) / 65535.0, 0.0, 1.0)
    return np.array(img.convert("RGB"))


def _decode(path: Path, convert: Callable[[Image.Image], _T]) -> _T:
    """Open ``path`` and convert it, turning decoding failures into a ``DatasetError`` that names the file."""
    try:
        with load_image(path) as img:
            return convert(img)
    except DatasetError:
        raise
    except UNREADABLE_FILE_ERRORS as err:
        raise DatasetError(f"cannot decode {path} ({err}); replace or delete the file") from err


def _pair_files(
    images: dict[str, FileInfo], masks: dict[str, FileInfo], mask_suffix: str, images_dir: Path, mask_dir: Path
) -> list[MaskPair]:
    """Pair each image with its mask; a missing mask is an error, a mask without an image a warning."""
    pairs, missing = [], []
    for name in sorted(images):
        mask = masks.get(name + mask_suffix)
        if mask is None:
            missing.append(images[name].path.name)
        else:
            pairs.append(MaskPair(name, images[name], mask))
    if missing:
        expected = f"<id>{mask_suffix}.<ext>"
        hint = _suffix_hint(images.keys(), masks.keys(), mask_suffix)
        raise DatasetError(
            f"{len(missing)} of {len(images)} images in {images_dir} have no mask named {expected} in {mask_dir}: "
            f"{format_examples(missing)}; add their masks or remove those images{hint}"
        )
    used = {name + mask_suffix for name in images}
    orphans = sorted(info.path.name for stem, info in masks.items() if stem not in used)
    if orphans:
        logger.warning(
            "%d mask(s) in %s have no image in %s and are ignored: %s",
            len(orphans),
            mask_dir,
            images_dir,
            format_examples(orphans),
        )
    return pairs


def _suffix_hint(image_ids: Iterable[str], mask_stems: Iterable[str], mask_suffix: str) -> str:
    """Suggest the other mask naming when it would match more images than the one in use."""
    other = "" if mask_suffix == CARVANA_MASK_SUFFIX else CARVANA_MASK_SUFFIX
    if _count_named(image_ids, mask_stems, other) > _count_named(image_ids, mask_stems, mask_suffix):
        if other:
            return f" (the masks look named <id>{other}.<ext>: use CarvanaDataset or mask_suffix='{other}')"
        return " (the masks look named <id>.<ext>: use BasicDataset with mask_suffix='')"
    return ""


def _count_named(image_ids: Iterable[str], mask_stems: Iterable[str], suffix: str) -> int:
    stems = set(mask_stems)
    return sum(1 for name in image_ids if name + suffix in stems)


def _check_no_empty_files(pairs: list[MaskPair]) -> None:
    empty = [str(info.path) for pair in pairs for info in (pair.image, pair.mask) if info.size == 0]
    if empty:
        raise DatasetError(
            f"{len(empty)} file(s) are empty (0 bytes), e.g. from an interrupted copy: {format_examples(empty)}; "
            "copy them again or delete them"
        )


def _check_value_count(mask_values: MaskValues, n_classes: int | None, mask_dir: Path, *, jpeg: bool) -> None:
    if len(mask_values) == 1:
        logger.warning("Every mask in %s has the single value %s: there is nothing to learn", mask_dir, mask_values[0])
    if n_classes is None:
        return
    allowed = 2 if n_classes == 1 else n_classes
    if n_classes >= 2 and len(mask_values) < n_classes:
        logger.warning(
            "The masks in %s contain %d distinct values (%s) but n_classes=%d: value mask_values[k] becomes class k, "
            "so classes %d..%d never occur in training",
            mask_dir,
            len(mask_values),
            mask_values,
            n_classes,
            len(mask_values),
            n_classes - 1,
        )
    if len(mask_values) <= allowed:
        return
    shown = ", ".join(str(v) for v in mask_values[:10]) + (", ..." if len(mask_values) > 10 else "")
    message = (
        f"the masks in {mask_dir} contain {len(mask_values)} distinct values ({shown}) but n_classes={n_classes} "
        f"allows at most {allowed}; train with --classes {len(mask_values)} if each value is a class"
    )
    if jpeg:
        message += ", or re-save the JPEG masks as PNG/GIF (JPEG compression noise creates the extra values)"
    raise DatasetError(message)


def _check_scaled_sizes(sizes: dict[str, tuple[int, int]], scale: float, images: dict[str, FileInfo]) -> None:
    too_small = [
        f"{images[name].path.name} ({width}x{height})"
        for name, (width, height) in sorted(sizes.items())
        if int(scale * width) <= 0 or int(scale * height) <= 0
    ]
    if too_small:
        raise DatasetError(
            f"scale {scale} shrinks {len(too_small)} image(s) to zero pixels: {format_examples(too_small)}; "
            "use a larger --scale or remove those images"
        )


def _extension_list() -> str:
    return " ".join(sorted(IMAGE_EXTENSIONS))
