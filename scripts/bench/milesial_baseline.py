"""A stand-in for milesial/Pytorch-UNet's ``train.py``: its documented training loop, written here as a baseline.

milesial's script cannot be downloaded here and its code is not copied into this project; this module does what its
loop is documented to do, so that the benchmark's ``epoch`` section can time both with the same flags, in turn:

* one process; a ``BasicDataset``-style data set: at construction a ``multiprocessing.Pool`` (one process per CPU)
  opens every mask for its unique values; each item is read with PIL, resized by ``--scale`` (bicubic images, nearest
  masks), mapped to class indices value by value and divided by 255, in ``DataLoader`` workers
  (``num_workers=os.cpu_count()``, ``pin_memory=True``);
* ``random_split`` with 10 % validation (generator seeded 0); the validation loader drops its last partial batch;
* the model and the images in ``channels_last``; RMSprop(lr, weight_decay=1e-8, momentum=0.999, foreach=True);
  ReduceLROnPlateau('max', patience=5) stepped on the validation Dice;
* loss: cross entropy (BCE with logits for 1 class) plus the Dice loss of the softmax (sigmoid) against the one-hot
  masks, under ``torch.autocast(device.type, enabled=amp)`` (bf16 on a CPU); a GradScaler on CUDA (milesial's
  ``torch.cuda.amp.GradScaler`` disables itself without CUDA); gradients clipped to norm 1.0; ``loss.item()`` each
  step (its progress bar);
* a validation over the whole validation set every ``n_train // (5 * batch_size)`` steps (mean Dice of the argmax
  one-hot, background left out);
* ``torch.save`` of the state dict plus ``mask_values`` at each epoch's end, as ``checkpoint_epoch{N}.pth``.

Left out: wandb (milesial logs to it anonymously online; nothing can reach a server here), with the weight and gradient
histograms it sends at each validation. Both leave the baseline faster than the original, not slower.

The model is this project's ``unet.UNet`` (milesial's architecture, same defaults), so that the pair times the two
loops around the same network. Run as ``python -m scripts.bench.milesial_baseline --imgs ... --masks ...``: the
benchmark times the whole process, start-up included, as it times ``train.py``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from multiprocessing import Pool
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset, random_split

from unet import UNet

logger = logging.getLogger(__name__)

RESULT_PREFIX = "MILESIAL_BASELINE_RESULT "
CHECKPOINT_NAME = "checkpoint_epoch{epoch}.pth"


@dataclass(frozen=True)
class BaselineFlags:
    """milesial's flags (``-e -b -l -s -v --amp -c``) plus where the data and checkpoints are and the model's width."""

    images_dir: Path
    masks_dir: Path
    checkpoint_dir: Path
    epochs: int = 5
    batch_size: int = 1
    learning_rate: float = 1e-5
    scale: float = 0.5
    validation_percent: float = 10.0
    amp: bool = False
    classes: int = 2
    base_channels: int = 64
    device: str = "cpu"


@dataclass(frozen=True)
class BaselineRun:
    """What one baseline run did: its wall time inside the process, its split and the precision it trained in."""

    wall_s: float
    train_images: int
    val_images: int
    validations: int
    precision: str
    checkpoint: str


# ------------------------------------------------------------------------------------------------------------ data


def unique_mask_values(name: str, masks_dir: Path, mask_suffix: str) -> np.ndarray:
    """The values one mask holds (rows of colours for an RGB mask): the data set's construction scan."""
    mask = np.asarray(Image.open(_mask_file(masks_dir, name, mask_suffix)))
    if mask.ndim == 2:
        return np.unique(mask)
    return np.unique(mask.reshape(-1, mask.shape[-1]), axis=0)


def _mask_file(masks_dir: Path, name: str, mask_suffix: str) -> Path:
    found = sorted(masks_dir.glob(f"{name}{mask_suffix}.*"))
    if len(found) != 1:
        raise FileNotFoundError(f"{masks_dir}: expected one mask {name}{mask_suffix}.*, found {len(found)}")
    return found[0]


def preprocess(mask_values: list[Any], image: Image.Image, scale: float, *, is_mask: bool) -> np.ndarray:
    """Resize by ``scale``; a mask becomes class indices (int64), an image CHW floats in [0, 1]."""
    width, height = image.size
    new_width, new_height = int(scale * width), int(scale * height)
    if new_width <= 0 or new_height <= 0:
        raise ValueError(f"--scale {scale} leaves no pixels of a {width}x{height} image: raise it")
    image = image.resize((new_width, new_height), resample=Image.NEAREST if is_mask else Image.BICUBIC)
    pixels = np.asarray(image)
    if is_mask:
        mask = np.zeros((new_height, new_width), dtype=np.int64)
        for index, value in enumerate(mask_values):
            if pixels.ndim == 2:
                mask[pixels == value] = index
            else:
                mask[(pixels == value).all(-1)] = index
        return mask
    pixels = pixels[np.newaxis, ...] if pixels.ndim == 2 else pixels.transpose((2, 0, 1))
    return pixels / 255.0 if (pixels > 1).any() else pixels


class PairDataset(Dataset):
    """Image/mask pairs by file name (``NAME.*`` and ``NAME{mask_suffix}.*``), loaded the ``BasicDataset`` way."""

    def __init__(self, images_dir: Path, masks_dir: Path, scale: float, mask_suffix: str = "_mask") -> None:
        self.images_dir, self.masks_dir, self.scale, self.mask_suffix = images_dir, masks_dir, scale, mask_suffix
        self.ids = sorted(p.stem for p in images_dir.iterdir() if p.is_file() and not p.name.startswith("."))
        if not self.ids:
            raise RuntimeError(f"No input file found in {images_dir}, make sure you put your images there")
        logger.info("Creating dataset with %d examples; scanning mask files to determine unique values", len(self.ids))
        with Pool() as pool:
            uniques = pool.map(partial(unique_mask_values, masks_dir=masks_dir, mask_suffix=mask_suffix), self.ids)
        self.mask_values = sorted(np.unique(np.concatenate(uniques), axis=0).tolist())
        logger.info("Unique mask values: %s", self.mask_values)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        name = self.ids[index]
        image_files = sorted(self.images_dir.glob(f"{name}.*"))
        mask = Image.open(_mask_file(self.masks_dir, name, self.mask_suffix))
        image = Image.open(image_files[0])
        if image.size != mask.size:
            raise ValueError(f"{name}: image {image.size} and mask {mask.size} differ in size")
        image_array = preprocess(self.mask_values, image, self.scale, is_mask=False)
        mask_array = preprocess(self.mask_values, mask, self.scale, is_mask=True)
        return {
            "image": torch.as_tensor(image_array.copy()).float().contiguous(),
            "mask": torch.as_tensor(mask_array.copy()).long().contiguous(),
        }


# ------------------------------------------------------------------------------------------------------ the metric


def dice_coefficient(
    prediction: torch.Tensor, target: torch.Tensor, *, reduce_batch_first: bool = False, epsilon: float = 1e-6
) -> torch.Tensor:
    """Mean Dice over the batch (or over the batch at once); an empty prediction of an empty target scores 1."""
    sum_dims = (-1, -2) if prediction.dim() == 2 or not reduce_batch_first else (-1, -2, -3)
    intersection = 2 * (prediction * target).sum(dim=sum_dims)
    sets_sum = prediction.sum(dim=sum_dims) + target.sum(dim=sum_dims)
    sets_sum = torch.where(sets_sum == 0, intersection, sets_sum)
    return ((intersection + epsilon) / (sets_sum + epsilon)).mean()


def multiclass_dice_coefficient(
    prediction: torch.Tensor, target: torch.Tensor, *, reduce_batch_first: bool = False
) -> torch.Tensor:
    """Dice over every class channel at once (``(N, C, H, W)`` flattened to ``(N * C, H, W)``)."""
    return dice_coefficient(prediction.flatten(0, 1), target.flatten(0, 1), reduce_batch_first=reduce_batch_first)


def dice_loss(prediction: torch.Tensor, target: torch.Tensor, *, multiclass: bool) -> torch.Tensor:
    score = multiclass_dice_coefficient if multiclass else dice_coefficient
    return 1 - score(prediction, target, reduce_batch_first=True)


@torch.inference_mode()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device, *, amp: bool, classes: int) -> float:
    """Mean Dice over the whole validation loader (the background class left out); the model back in train mode."""
    model.eval()
    total = 0.0
    with torch.autocast(device.type, enabled=amp):
        for batch in loader:
            images = batch["image"].to(device=device, dtype=torch.float32, memory_format=torch.channels_last)
            masks = batch["mask"].to(device=device, dtype=torch.long)
            logits = model(images)
            if classes == 1:
                predicted = (torch.sigmoid(logits.squeeze(1)) > 0.5).float()
                total += dice_coefficient(predicted, masks.float()).item()
            else:
                predicted = F.one_hot(logits.argmax(dim=1), classes).permute(0, 3, 1, 2).float()
                truth = F.one_hot(masks, classes).permute(0, 3, 1, 2).float()
                total += multiclass_dice_coefficient(predicted[:, 1:], truth[:, 1:]).item()
    model.train()
    return total / max(len(loader), 1)


# ---------------------------------------------------------------------------------------------------- the training


def train(flags: BaselineFlags) -> BaselineRun:
    """milesial's loop for ``flags.epochs`` epochs; the seconds it took (model build to the last checkpoint)."""
    started = time.perf_counter()
    device = torch.device(flags.device)
    model = UNet(n_channels=3, n_classes=flags.classes, base_channels=flags.base_channels)
    model = model.to(memory_format=torch.channels_last).to(device=device)

    dataset = PairDataset(flags.images_dir, flags.masks_dir, flags.scale)
    n_val = int(len(dataset) * flags.validation_percent / 100)
    n_train = len(dataset) - n_val
    train_set, val_set = random_split(dataset, [n_train, n_val], generator=torch.Generator().manual_seed(0))
    loader_args = {"batch_size": flags.batch_size, "num_workers": os.cpu_count() or 1, "pin_memory": True}
    train_loader = DataLoader(train_set, shuffle=True, **loader_args)
    val_loader = DataLoader(val_set, shuffle=False, drop_last=True, **loader_args)

    optimizer = torch.optim.RMSprop(
        model.parameters(), lr=flags.learning_rate, weight_decay=1e-8, momentum=0.999, foreach=True
    )
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, "max", patience=5)
    # milesial's torch.cuda.amp.GradScaler(enabled=amp) turns itself off where there is no CUDA.
    grad_scaler = torch.amp.GradScaler("cuda", enabled=flags.amp and device.type == "cuda")
    criterion = nn.CrossEntropyLoss() if flags.classes > 1 else nn.BCEWithLogitsLoss()
    division_step = n_train // (5 * flags.batch_size)
    global_step = validations = 0
    precision = "fp32"
    checkpoint = flags.checkpoint_dir / CHECKPOINT_NAME.format(epoch=0)

    for epoch in range(1, flags.epochs + 1):
        model.train()
        epoch_loss = 0.0
        for batch in train_loader:
            images = batch["image"].to(device=device, dtype=torch.float32, memory_format=torch.channels_last)
            masks = batch["mask"].to(device=device, dtype=torch.long)
            with torch.autocast(device.type, enabled=flags.amp):
                logits = model(images)
                if flags.classes == 1:
                    loss = criterion(logits.squeeze(1), masks.float())
                    loss = loss + dice_loss(torch.sigmoid(logits.squeeze(1)), masks.float(), multiclass=False)
                else:
                    one_hot = F.one_hot(masks, flags.classes).permute(0, 3, 1, 2).float()
                    loss = criterion(logits, masks)
                    loss = loss + dice_loss(F.softmax(logits, dim=1).float(), one_hot, multiclass=True)
            precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(logits.dtype, "fp32")
            optimizer.zero_grad(set_to_none=True)
            grad_scaler.scale(loss).backward()
            grad_scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            grad_scaler.step(optimizer)
            grad_scaler.update()
            global_step += 1
            epoch_loss += loss.item()  # milesial's progress bar and wandb read it every step
            if division_step > 0 and global_step % division_step == 0:
                val_score = evaluate(model, val_loader, device, amp=flags.amp, classes=flags.classes)
                scheduler.step(val_score)
                validations += 1
                logger.info("Validation Dice score: %.4f", val_score)
        flags.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        state_dict: dict[str, Any] = model.state_dict()
        state_dict["mask_values"] = dataset.mask_values
        checkpoint = flags.checkpoint_dir / CHECKPOINT_NAME.format(epoch=epoch)
        torch.save(state_dict, checkpoint)
        logger.info("Checkpoint %d saved (epoch loss %.4f)", epoch, epoch_loss)
    return BaselineRun(
        wall_s=time.perf_counter() - started,
        train_images=n_train,
        val_images=n_val,
        validations=validations,
        precision=precision,
        checkpoint=str(checkpoint),
    )


def parse_flags(argv: Sequence[str] | None = None) -> BaselineFlags:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--imgs", type=Path, required=True, help="folder of images")
    parser.add_argument("--masks", type=Path, required=True, help="folder of masks (NAME_mask.*)")
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--epochs", "-e", type=int, default=5)
    parser.add_argument("--batch-size", "-b", type=int, default=1)
    parser.add_argument("--learning-rate", "-l", type=float, default=1e-5)
    parser.add_argument("--scale", "-s", type=float, default=0.5)
    parser.add_argument("--validation", "-v", type=float, default=10.0, help="percent held out (0-100)")
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--classes", "-c", type=int, default=2)
    parser.add_argument("--base-channels", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    return BaselineFlags(
        images_dir=args.imgs,
        masks_dir=args.masks,
        checkpoint_dir=args.checkpoint_dir,
        epochs=args.epochs,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        scale=args.scale,
        validation_percent=args.validation,
        amp=args.amp,
        classes=args.classes,
        base_channels=args.base_channels,
        device=args.device,
    )


def read_result(output: str) -> dict[str, Any] | None:
    """The result line a baseline process printed (None when it printed none)."""
    lines = [line for line in output.splitlines() if line.startswith(RESULT_PREFIX)]
    return json.loads(lines[-1][len(RESULT_PREFIX) :]) if lines else None


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    run = train(parse_flags(argv))
    print(RESULT_PREFIX + json.dumps(run.__dict__), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
