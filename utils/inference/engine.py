"""Prediction: the model and its preparation, decoding inputs in loader workers, batching images of equal size,
optional tiling, logits to classes; what evaluation adds to the same start.

``predict_items`` is the loop behind ``predict.py``: images are decoded and resized in ``DataLoader`` workers (so
decoding overlaps the forward passes), grouped into batches of equal network-input size (images of mixed sizes
never get padded, so each prediction is exactly what the model gives for that image alone), run under the chosen
precision, and the logits are resized bilinearly to the original size before the sigmoid threshold or argmax, as in
milesial/Pytorch-UNet's ``predict_img``.

Tiled inference (``TileSettings``, for images too large to run whole) lives in ``utils.inference.tiling``.

evaluate.py shares the start and the loader, and adds its own: the dataset's mask values mapped to the checkpoint's
classes (``align_mask_values``), ``--split``'s validation images (``validation_subset``) and stacked batches of one
size (``SizeGroupedBatches``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset, Subset
from tqdm import tqdm

from unet import UNet
from utils.checkpoint import model as model_spec
from utils.datasets.dataset import BasicDataset, PixelCache, cached_image, image_tensor, resized_image, unit_float
from utils.datasets.image_files import FileInfo, format_examples, image_header, load_image, mode_channels
from utils.datasets.splits import read_split_file
from utils.errors import CheckpointError, ConfigError, DatasetError
from utils.evaluation import predict_classes
from utils.hardware import SharedMemoryGuard, guarded_loader, pick_device, warn_if_emulated
from utils.inference.config import DEFAULT_MASK_THRESHOLD, EvaluateConfig, InferenceConfig, PredictConfig
from utils.inference.export import Preprocessing
from utils.inference.tiling import MemoryPlanner, forward_logits, predict_logits_tiled

logger = logging.getLogger(__name__)

T = TypeVar("T")


def open_model(config: InferenceConfig) -> tuple[torch.device, UNet, model_spec.ModelSpec, float]:
    """Where predict.py and evaluate.py start: the device (--device), the checkpoint's model on the CPU (checked
    against --classes/--bilinear), its spec and the image scale (--scale or the checkpoint's)."""
    device = pick_device(config.device)
    warn_if_emulated(device, config.precision)
    model, spec = model_spec.load_model(
        config.model, expected={"n_classes": config.classes, "bilinear": True if config.bilinear else None}
    )
    return device, model, spec, model_spec.resolve_scale(spec, config.scale, config.model)


def load_predictor(config: PredictConfig) -> tuple[torch.device, UNet, Preprocessing]:
    """``open_model``'s device and model (in eval mode), and how predict.py prepares images for it and writes its
    classes: the image scale, the mask value of each class, void values and class names (empty when the checkpoint
    has none)."""
    device, model, spec, scale = open_model(config)
    mask_values, inference = mask_values_to_write(spec, config.model), spec.inference
    logger.info("Model %s: %s, mask values %s, scale %s", config.model, model.constructor_args(), mask_values, scale)
    if model.n_classes > 1 and config.mask_threshold != DEFAULT_MASK_THRESHOLD:
        logger.warning(
            "--mask-threshold %s is ignored: %s has %d output classes and each pixel gets its most likely class "
            "(the threshold applies to one-logit models, --classes 1)",
            config.mask_threshold,
            config.model,
            model.n_classes,
        )
    preprocessing = Preprocessing(scale, mask_values, model.n_channels, inference.ignore_values, inference.class_names)
    return device, model.eval(), preprocessing


MAX_PNG_GREY_VALUE = 2**16 - 1


def mask_values_to_write(spec: model_spec.ModelSpec, checkpoint: Path) -> list:
    """The mask value each class is written as: the checkpoint's, else ``[0, 1]`` for a binary model (milesial's
    default) and the class numbers for more classes, with one warning.

    ``CheckpointError`` for values a mask file cannot hold: a grey value too wide for a 16-bit PNG (written as it is
    it would wrap around: another class's value, silently), or a void value (``--ignore-value`` in training), which
    would read back as "not labelled". Everything else about them (one per class, unique, integers or colours of 2-4
    channels of 0..255) is checked where the file is read (``utils.checkpoint.model``).
    """
    mask_values = spec.mask_values
    if mask_values is None:
        mask_values = [0, 1] if spec.n_classes <= 2 else list(range(spec.n_classes))
        logger.warning("%s stores no mask_values; writing classes as %s", checkpoint, mask_values)
    too_wide = [value for value in mask_values if not isinstance(value, Sequence) and value > MAX_PNG_GREY_VALUE]
    if too_wide:
        raise CheckpointError(
            f"the checkpoint's mask value {too_wide[0]} does not fit a 16-bit PNG mask (at most {MAX_PNG_GREY_VALUE}); "
            f"evaluate.py scores this model, but its masks cannot be written as images"
        )
    void = sorted(set(spec.inference.ignore_values) & {value for value in mask_values if isinstance(value, int)})
    if void:
        raise CheckpointError(
            f"{checkpoint} maps classes to mask value(s) {void} that it was trained to ignore (--ignore-value); "
            "its mask_values are inconsistent, retrain or fix the checkpoint"
        )
    return mask_values


@dataclass
class InputItem:
    """One decoded input image, or the reason it could not be decoded, and once predicted its classes."""

    index: int
    path: Path
    image: Tensor | None = None
    """``[C, h, w]`` float32 in [0, 1] at network-input size."""
    original_size: tuple[int, int] = (0, 0)
    """``(height, width)`` of the file's image: predictions are resized back to it."""
    original: Tensor | None = None
    """``[C, H, W]`` uint8 pixels of the file, kept only for visualisation."""
    error: str | None = None
    converted: bool = False
    """Whether the file's photo was converted to the model's kind (grey to RGB, or the reverse)."""
    classes: np.ndarray | None = None
    """Class indices ``[H, W]`` at ``original_size`` (``predict_items``); none when the input could not be read."""


class PredictionInputs(Dataset):
    """Decodes and resizes input files; a file that cannot be used becomes an item with ``error`` set, not a crash.

    A grey photo for an RGB model is converted to RGB, a colour photo for a grey model to grey (PIL's luma), as
    training does; ``predict_items`` warns once with the count of such files. Images are prepared as
    ``preprocessing`` says (scale, channels); ``config`` adds --viz (the full-size pixels are kept), --tile (any size
    is read: PIL's pixel limit is for whole images, --tile holds a window's activations at a time) and --pixel-cache.
    """

    def __init__(self, paths: Sequence[Path], preprocessing: Preprocessing, config: PredictConfig) -> None:
        self.paths = list(paths)
        self.scale, self.n_channels = preprocessing.scale, preprocessing.channels
        self.keep_original, self.any_size = config.viz, config.tile is not None
        # --pixel-cache: the training cache's entries (same scale and channels) are read instead of decoding, and
        # a decoded input is stored for the next run. Not with --viz, which needs the full-size pixels anyway.
        self.pixel_cache = None
        if config.pixel_cache is not None and not config.viz and self.n_channels in (1, 3):
            self.pixel_cache = PixelCache(config.pixel_cache, scale=self.scale, channels=self.n_channels)
            self.pixel_cache.check_outside(*{path.parent for path in self.paths})
        # The dataset's conversion (grey <-> RGB by PIL mode) exists for 1- and 3-channel models only.
        self._convert_to = self.n_channels if self.n_channels in (1, 3) else None

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> InputItem:
        path = self.paths[index]
        header = original = None  # set when the file is decoded (not on a pixel-cache hit)

        def decode() -> Tensor:
            nonlocal header, original
            with load_image(path, any_size=self.any_size) as pil_image:
                header = pil_image.width, pil_image.height, mode_channels(pil_image.mode)
                if self.keep_original:
                    # Full size for --viz, converted like the model's input (palette, 16-bit, ... handled).
                    original = image_tensor(pil_image, 1.0).mul_(255).round_().to(torch.uint8)
                # The training pipeline's conversion and resize, so predictions see what the model was trained on.
                return resized_image(pil_image, self.scale, self._convert_to)

        try:
            # --pixel-cache: the entry training stored under the file's record (FileInfo.of), else decoded and stored.
            image = cached_image(self.pixel_cache, FileInfo.of(path), decode)
            # On a cache hit the header gives the original size.
            width, height, own_channels = header or image_header(path)
            if image.shape[0] != self.n_channels:
                raise ValueError(f"it has {image.shape[0]} channel(s) but the model expects {self.n_channels}")
        except Exception as error:  # noqa: BLE001 - any decoding failure is reported per file and the run goes on
            return InputItem(index, path, error=f"cannot read image {path}: {str(error) or type(error).__name__}")
        converted = own_channels != self.n_channels  # grey for an RGB model, or the reverse
        return InputItem(index, path, unit_float(image), (height, width), original, converted=converted)


def item_loader(dataset: Dataset, *, batch_size: int, workers: int, pin_memory: bool = False) -> SharedMemoryGuard:
    """predict.py's and evaluate.py's loader (``guarded_loader``): lists of ``batch_size`` items (not stacked:
    images of different sizes cannot be yet), decoded by ``workers`` processes."""
    return guarded_loader(
        dataset,
        batch_size=batch_size,
        workers=workers,
        workers_fix="--workers 0 (-j 0)",  # the flag that keeps decoding in the main process
        collate_fn=list,  # the items kept apart; a builtin pickles for workers under any start method
        pin_memory=pin_memory,
    )


def batches_by_shape(
    items: Iterable[T], batch_size: int, shape_of: Callable[[T], tuple[int, ...] | None]
) -> Iterator[list[T]]:
    """Batches of up to ``batch_size`` items of one image shape (``shape_of``), in the order they fill up, so that
    interleaved sizes still make full batches; nothing is resized or padded.

    At most ``4 * batch_size`` items wait; beyond that the fullest partial batch goes early (many distinct sizes would
    otherwise hold every image in memory). An item of shape None (an input that could not be read) goes alone, at once.
    """
    waiting: dict[tuple[int, ...] | None, list[T]] = {}
    for item in items:
        shape = shape_of(item)
        bucket = waiting.setdefault(shape, [])
        bucket.append(item)
        if shape is None or len(bucket) == batch_size:
            yield waiting.pop(shape)
        elif sum(map(len, waiting.values())) > 4 * batch_size:
            yield waiting.pop(max(waiting, key=lambda key: len(waiting[key])))
    yield from waiting.values()


def logits_to_classes(logits: Tensor, size: tuple[int, int], threshold: float) -> np.ndarray:
    """``[K, h, w]`` logits to ``[H, W]`` uint8 class indices at ``size``: resize the logits first, then decide
    (milesial)."""
    resized = F.interpolate(logits[None], size=size, mode="bilinear", align_corners=False)
    return predict_classes(resized, threshold)[0].to(torch.uint8).cpu().numpy()


def predict_items(
    model: nn.Module,
    dataset: PredictionInputs,
    device: torch.device,
    config: PredictConfig,
    memory: MemoryPlanner | None = None,
) -> Iterator[InputItem]:
    """Yield every input with its ``classes`` (in completion order, not input order); unreadable ones carry ``error``.

    Batches of one network-input size are predicted as ``config`` says (precision, threshold, --tta, --tile: windows
    run --batch-size at a time); it also gives the batch size, the loader workers and the progress bar. Without
    ``--tile``, each batch is first checked against ``memory`` (default: the device's free memory); a batch whose
    whole-image pass would not fit runs in windows the planner sizes, with one warning.
    """
    model.eval()
    planner = memory if memory is not None else MemoryPlanner(device=device)

    @torch.inference_mode()
    def predict(items: list[InputItem]) -> list[InputItem]:
        """A batch of items whose network-input images all have the same shape; an unreadable input as it is."""
        if items[0].error is not None:
            return items
        images = torch.stack([item.image for item in items])  # type: ignore[misc] - decoded items only
        # Without --tile, the planner decides whether the whole-image pass fits, else which windows to use.
        tile = config.tile_settings() or planner.tile_if_needed(model, images.shape, config.tta, config.batch_size)
        images = images.to(device, non_blocking=True)
        if tile is None:
            logits = forward_logits(model, images, config.precision, config.tta)
        else:
            logits = predict_logits_tiled(model, images, tile, config.precision, config.batch_size)
        return [
            replace(item, classes=logits_to_classes(item_logits, item.original_size, config.mask_threshold))
            for item, item_logits in zip(items, logits, strict=True)
        ]

    loader = item_loader(dataset, batch_size=config.batch_size, workers=config.workers)
    items = itertools.chain.from_iterable(loader)
    batches = batches_by_shape(items, config.batch_size, lambda item: None if item.error else item.image.shape)
    predicted = itertools.chain.from_iterable(map(predict, batches))
    converted = 0
    for item in tqdm(predicted, total=len(dataset), desc="Predicting", unit="img", disable=not config.progress):
        converted += item.converted
        yield item
    if converted:
        kind, target = ("grey", "RGB") if dataset.n_channels == 3 else ("colour", "grey")
        logger.warning(
            "%d %s image(s) were converted to %s for the %d-channel model", converted, kind, target, dataset.n_channels
        )


def align_mask_values(dataset: BasicDataset, checkpoint_values: list | None, checkpoint: Path) -> list:
    """Make the dataset map mask values to the checkpoint's classes; raise ``DatasetError`` if it cannot.

    A validation set may lack some classes, so its values only need to be among the checkpoint's; the dataset then
    uses the checkpoint's full list, so that value ``v`` becomes the class the model was trained to predict for it.
    """
    dataset_values = [_comparable(value) for value in dataset.mask_values]
    if checkpoint_values is None:
        logger.warning(
            "%s stores no mask_values; assuming the masks' values %s are its classes in order",
            checkpoint,
            dataset.mask_values,
        )
        return list(dataset.mask_values)
    known = [_comparable(value) for value in checkpoint_values]
    unknown = [value for value in dataset_values if value not in known]
    if unknown:
        raise DatasetError(
            f"the masks in {dataset.mask_dir} hold values {dataset.mask_values} but {checkpoint} was trained on "
            f"{list(checkpoint_values)} ({unknown} unknown to it); evaluate on masks made the same way as its "
            "training masks"
        )
    if dataset_values != known:
        logger.info("The masks use %s of the checkpoint's mask values %s", dataset.mask_values, checkpoint_values)
        dataset.mask_values = list(checkpoint_values)
    return list(checkpoint_values)


def _comparable(value: object) -> object:
    return tuple(int(channel) for channel in value) if isinstance(value, list | tuple) else int(value)


@dataclass(frozen=True)
class SizeGroupedBatches:
    """Stacked batches of up to the loader's ``batch_size`` items of one image size, from ``engine.item_loader``'s
    lists of items.

    Images of mixed sizes are grouped by size as ``predict.py`` groups them (``batches_by_shape``): since the score is a
    mean over images, grouping does not change it.
    """

    loader: SharedMemoryGuard

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        items = itertools.chain.from_iterable(self.loader)
        for batch in batches_by_shape(items, self.loader.batch_size, lambda item: item["image"].shape):
            yield {key: torch.stack([item[key] for item in batch]) for key in batch[0]}


def validation_subset(dataset: BasicDataset, config: EvaluateConfig, trained_on: str | None) -> Dataset:
    """``--split``: exactly the validation images of the run that wrote the file (``dataset`` whole without it),
    whatever else the folders hold.

    ``trained_on`` is the split digest the checkpoint records (None: not recorded): another split is refused unless
    ``--other-split`` (its validation images may be the model's training images). A DatasetError when some are not
    in the dataset.
    """
    if config.split_path is None:
        return dataset
    record = read_split_file(config.split_path)
    if trained_on is not None and record.digest != trained_on and not config.other_split:
        raise ConfigError(
            f"--split {config.split_path} is not the split {config.model} was trained on (its recorded split_sha256 "
            f"differs), so its validation images may be training images of the model; pass the split.json of the "
            f"model's run folder, or add --other-split to score this split anyway"
        )
    position = {image_id: index for index, image_id in enumerate(dataset.ids)}
    missing = [image_id for image_id in record.validation if image_id not in position]
    if missing:
        raise DatasetError(
            f"{len(missing)} of the {len(record.validation)} validation images of --split {config.split_path} are not "
            f"in the folders given: {format_examples(missing)}; pass the --imgs and --masks the run was trained on"
        )
    return Subset(dataset, sorted(position[image_id] for image_id in record.validation))
