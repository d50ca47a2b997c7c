"""Which mask belongs to which image: the mask naming (``<id>.<ext>`` or Carvana's ``<id>_mask.<ext>``) and the pairing.

Decided by file names only, from the folder indexes of ``utils.datasets.image_files.index_folder``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from utils.datasets.image_files import FileInfo, index_folder
from utils.datasets.mask_values import MaskPair, format_examples
from utils.errors import DatasetError

logger = logging.getLogger(__name__)

CARVANA_MASK_SUFFIX = "_mask"


def detect_mask_suffix(images_dir: str | Path, mask_dir: str | Path) -> str:
    """Return ``"_mask"`` if the masks are named ``<id>_mask.<ext>`` after the images, else ``""``.

    Decided by file names only: whichever naming matches more images wins, ``""`` on a tie.
    """
    image_ids = index_folder(images_dir, "image").keys()
    mask_stems = index_folder(mask_dir, "mask").keys()
    return suffix_from_names(image_ids, mask_stems)


def pair_files(
    images: dict[str, FileInfo], masks: dict[str, FileInfo], mask_suffix: str, images_dir: Path, mask_dir: Path
) -> list[MaskPair]:
    """Pair each image with its mask; a missing mask is an error, a mask without an image a warning."""
    pairs, missing = [], []
    for name in sorted(images):
        mask = masks.get(name + mask_suffix)
        if mask is None:
            missing.append(images[name].name)
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
    orphans = sorted(info.name for stem, info in masks.items() if stem not in used)
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


def suffix_from_names(image_ids: Iterable[str], mask_stems: Iterable[str]) -> str:
    """``"_mask"`` if more images have a mask named ``<id>_mask`` than ``<id>``, else ``""`` (also on a tie)."""
    with_suffix = _count_named(image_ids, mask_stems, CARVANA_MASK_SUFFIX)
    return CARVANA_MASK_SUFFIX if with_suffix > _count_named(image_ids, mask_stems, "") else ""


def _count_named(image_ids: Iterable[str], mask_stems: Iterable[str], suffix: str) -> int:
    stems = set(mask_stems)
    return sum(1 for name in image_ids if name + suffix in stems)
