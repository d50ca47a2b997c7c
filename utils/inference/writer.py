"""What ``predict.py`` and ``evaluate.py`` read and write: the input files, where each one's outputs go (checked
before anything runs), masks and overlays encoded in writer threads (overlapping the next forward passes), predict's
last line (what was written where, so a person knows where to look), evaluate's table and ``--json``.

The outputs and the files they must not replace are listed here; ``utils.output_files.check_outputs`` compares them
(by file identity) and writes them.

Class ``k`` is written as ``mask_values[k]``, as in milesial/Pytorch-UNet's ``mask_to_image``, so a prediction can be
compared with (or used in place of) the masks the model was trained on:
* ``[0, 1]`` (Carvana) becomes a 1-bit PNG (PIL mode ``'1'``);
* other grey values become an 8-bit ``'L'`` image, or 16-bit ``'I;16'`` when a value does not fit in a byte;
* colour values (``[r, g, b]`` lists, one per class) become an ``'RGB'`` image (``'LA'``/``'RGBA'`` for 2/4 channels).

Overlays (``--viz``), with the true mask beside them when one is given: class 0 is treated as background and left
undrawn; the other classes are painted over the image in their own colour: the dataset's colour when its mask values
are colours, else a fixed palette. A half-transparent colour can vanish on an object of about that colour (red on a
maroon car), so each region also gets a one-pixel outline on its inside edge, black or white, whichever stands out
more from the image under it. Below the image(s) a white strip holds the captions (``truth`` under the true mask's
overlay, ``prediction`` under the model's) and a legend: a swatch of each foreground class's colour labelled with its
name (``--class-names`` in training) or else its mask value (``value 255``), the value a person finds in the mask
files. The image pixels themselves carry no text.

Each file goes through ``utils.output_files`` (all or nothing). A failure of one file is that image's failure; a
failure of the output location (a full disk, a read-only folder) ends the run with one error, since every later
write would fail the same way.
"""

from __future__ import annotations

import glob
import json
import logging
import tempfile
from collections import deque
from collections.abc import Generator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from torch import Tensor

from utils.datasets.dataset import mask_classes
from utils.datasets.image_files import (
    IMAGE_EXTENSIONS,
    OUTPUT_SUFFIX,
    PREDICTION_SUFFIXES,
    VIZ_SUFFIX,
    index_folder,
    load_image,
)
from utils.errors import ConfigError, UserError, count
from utils.inference.config import MASK_FORMATS, EvaluateConfig, PredictConfig
from utils.output_files import OutputError, check_outputs, write_file, write_text

if TYPE_CHECKING:
    from utils.evaluation import EvalResult
    from utils.inference.engine import InputItem
    from utils.inference.export import Preprocessing

logger = logging.getLogger(__name__)


def collect_inputs(patterns: Sequence[str]) -> list[Path]:
    """Expand files, folders and globs into image files (in order, each once).

    Folders and globs skip earlier outputs (``*_OUT.*``, ``*_VIZ.*``), so predicting a folder twice does not predict
    the first run's masks. A missing file, an empty folder or a glob that matches nothing is an error.
    """
    found: list[Path] = []
    for pattern in patterns:
        path = Path(pattern)
        if path.is_file():
            images = [path]
        elif path.is_dir():
            # The one folder index, as train.py's and evaluate.py's: a link loop or a dangling link named like an
            # image is one line naming it, not a file silently left out.
            images = sorted(path / info.name for info in index_folder(path, "input image").values())
        elif glob.has_magic(pattern):
            images = [
                candidate
                for candidate in sorted(Path(match) for match in glob.glob(pattern))
                if candidate.is_file()
                and candidate.suffix.lower() in IMAGE_EXTENSIONS
                and not candidate.name.startswith(".")
                and not candidate.stem.endswith(PREDICTION_SUFFIXES)
            ]
        else:
            raise ConfigError(f"--input {pattern}: no such file or folder")
        if not images:
            raise ConfigError(f"--input {pattern}: no images ({', '.join(sorted(IMAGE_EXTENSIONS))}) found there")
        found.extend(images)
    return list(dict.fromkeys(found))


class OutputPlan(NamedTuple):
    """Where one input's mask and visualisation go."""

    mask: Path
    viz: Path


def plan_outputs(inputs: Sequence[Path], config: PredictConfig) -> list[OutputPlan]:
    """Output paths per input (``inputs`` as ``collect_inputs(config.inputs)`` found them), checked with --export's
    before anything runs: ``ConfigError`` on a count mismatch of ``--output``, an output over a file the run reads or
    must keep, or an output folder that cannot be written."""
    if config.outputs is not None:
        if not all(Path(pattern).is_file() for pattern in config.inputs):
            raise ConfigError("--output pairs outputs with input files; for folders and globs use --output-dir")
        if len(config.outputs) != len(inputs):
            raise ConfigError(
                f"--output got {len(config.outputs)} paths for {len(inputs)} input images; give one per input file"
            )
        masks = [(out, out.stem) for out in config.outputs]
    else:
        masks = [((config.output_dir or path.parent) / f"{path.stem}{OUTPUT_SUFFIX}.png", path.stem) for path in inputs]
    # An overlay goes beside its mask: <mask name>_VIZ.png, or <input name>_VIZ.png beside <input name>_OUT.png.
    plans = [OutputPlan(mask, mask.with_name(f"{stem}{VIZ_SUFFIX}.png")) for mask, stem in masks]
    outputs = [
        (output, f"the {role} of {path}")
        for path, plan in zip(inputs, plans, strict=True)
        for output, role, wanted in ((plan.mask, "mask", not config.no_save), (plan.viz, "overlay", config.viz))
        if wanted
    ]
    folders = {config.masks_dir: "a true mask in --masks"}
    guard_outputs(outputs, config.model, folders, inputs)
    if config.export_path is not None:
        # Neither the checkpoint, an input, a training run's file, nor an existing file without --overwrite.
        torchscript = config.overwrite and config.export_format == "torchscript"
        options = {"replaces_torchscript": torchscript, "overwrite": config.overwrite}
        guard_outputs([(config.export_path, "--export")], config.model, folders, inputs, writes_images=False, **options)
    # An input's mask and overlay share a folder.
    check_writable({plan.mask.parent for plan in plans})
    return plans


def guard_outputs(
    outputs: list[tuple[Path, str]],
    checkpoint: Path,
    folders: Mapping[Path | None, str],
    inputs: Sequence[Path] = (),
    **options: bool,
) -> None:
    """``check_outputs`` of ``outputs`` against every file the run reads or must keep, each with its role: the
    checkpoint, the ``inputs`` and each file directly in ``folders`` (``{--masks: "a true mask in --masks"}``; None:
    not given), which are with the inputs' own folders the folders it reads from."""
    protected: dict[Path, str] = {}
    for folder, role in folders.items():
        if folder is not None and folder.is_dir():
            protected.update((path, role) for path in folder.iterdir() if path.is_file())
    protected.update((path, "the input") for path in inputs)
    protected[checkpoint] = "the checkpoint"
    # A folder given as an input is its images' folder.
    read_from = [*(path.parent for path in inputs), *(folder for folder in folders if folder is not None)]
    check_outputs(outputs, protected, read_from, **options)


def check_writable(folders: set[Path]) -> None:
    """Create the output folders and prove each is writable, so a run never fails after hours of prediction."""
    for folder in sorted(folders):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as error:
            raise ConfigError(
                f"cannot write outputs to {folder}: {error.strerror or error}; choose another --output-dir/--output"
            ) from error


# Folders named in full; a run writing beside inputs in more folders names these and counts the rest.
MAX_FOLDERS_NAMED = 3
# Predictions written at most this many images ahead of the writer threads, to bound memory.
MAX_PENDING_WRITES = 16


def mask_to_image(class_mask: np.ndarray, mask_values: Sequence) -> Image.Image:
    """Map a ``[H, W]`` array of class indices to a PIL image holding ``mask_values[class]`` per pixel (one value
    per class the model predicts: the checkpoint's reader checked that, ``utils.checkpoint.model``); Pillow takes the
    mode from the table's type and shape (see the module docstring)."""
    assert class_mask.ndim == 2, class_mask.shape
    table = np.asarray(mask_values)
    if table.ndim == 2:  # colours of 2, 3 or 4 channels
        table = table.astype(np.uint8)
    elif len(table) == 2 and sorted(table.tolist()) == [0, 1]:
        table = table.astype(bool)
    else:
        table = table.astype(np.uint16 if table.max(initial=0) > 255 else np.uint8)
    return Image.fromarray(table[class_mask])


# Distinct, saturated colours for grey-valued masks (class 1 first), as RGB hex codes.
PALETTE = [tuple(bytes.fromhex(code)) for code in "ff4040 40c840 4080ff ffc800 c840ff 00dcdc ff8000 ff00a0".split()]
OVERLAY_ALPHA = 0.5
GAP_PIXELS = 8
# The caption and legend strip: text rows of this height and swatches of this side on small images, growing with the
# image (text 1/40 of its height) so that captions stay readable on a 1918x1280 photo; at most this many entries.
ROW_PIXELS = 16
SWATCH_PIXELS = 10
TEXT_HEIGHT_FRACTION = 1 / 40
MAX_LEGEND_ENTRIES = 32
CAPTIONS = ("truth", "prediction")
# Truth masks are looked up by the image's name plus one of these suffixes (Carvana uses "_mask").
TRUTH_SUFFIXES = ("", "_mask", "_masks", "-mask", "_label", "_labels", "_gt")
# Every extension a dataset mask may have (image_files), the lossless ones first.
MASK_FILE_SUFFIXES = (*MASK_FORMATS, *sorted(IMAGE_EXTENSIONS - set(MASK_FORMATS)))


def class_colours(mask_values: Sequence) -> list[tuple[int, int, int]]:
    """One RGB colour per class, as ``mask_values`` has one value per class (index 0, background, included for
    indexing but never drawn): the masks' own colours, else the palette."""
    if all(isinstance(value, Sequence) and len(value) >= 3 for value in mask_values):
        return [tuple(int(channel) for channel in value[:3]) for value in mask_values]
    return [(0, 0, 0)] + [PALETTE[(k - 1) % len(PALETTE)] for k in range(1, len(mask_values))]


def overlay(image: Tensor, classes: np.ndarray, colours: Sequence[tuple[int, int, int]]) -> Tensor:
    """Paint every non-background class of ``classes`` ``[H, W]`` over ``image`` ``[C, H, W]`` uint8."""
    # Any channel count to 3 for display: grey repeated, a fourth channel dropped.
    rgb = (image[:3] if image.shape[0] >= 3 else image[:1].expand(3, -1, -1)).contiguous()
    class_map = torch.from_numpy(np.asarray(classes, dtype=np.int64))
    present = [k for k in torch.unique(class_map).tolist() if k != 0]
    if not present:
        return rgb.clone()
    masks = torch.stack([class_map == k for k in present])
    from torchvision.utils import draw_segmentation_masks  # here: torchvision imports dynamo, seconds per start

    painted = draw_segmentation_masks(rgb, masks, alpha=OVERLAY_ALPHA, colors=[colours[k] for k in present])
    for mask in masks:
        edge = inside_edge(mask)
        # Rec. 601 luma of the image under the outline: a light background gets black, a dark one white.
        luma = (torch.tensor([0.299, 0.587, 0.114]) @ rgb[:, edge].float()).mean()
        painted[:, edge] = 0 if luma > 127 else 255
    return painted


def inside_edge(mask: Tensor) -> Tensor:
    """The pixels of ``mask`` ``[H, W]`` bool with a 4-neighbour outside it (the image border does not count)."""
    padded = torch.nn.functional.pad(mask[None, None].float(), (1, 1, 1, 1), mode="replicate")[0, 0] > 0.5
    interior = padded[:-2, 1:-1] & padded[2:, 1:-1] & padded[1:-1, :-2] & padded[1:-1, 2:]
    return mask & ~interior


def legend_entries(
    colours: Sequence[tuple[int, int, int]], mask_values: Sequence, class_names: Sequence[str] = ()
) -> list[tuple[tuple, str]]:
    """``(colour, label)`` for every foreground class (class 0 is not drawn), labelled as a person knows it: its name
    when the checkpoint has names, else its value in the mask files (``value 255``, ``value (128, 0, 0)``)."""
    entries = []
    for k in range(1, len(colours)):  # one colour per mask value (class_colours)
        value = mask_values[k]
        shown = tuple(int(channel) for channel in value) if isinstance(value, Sequence) else value  # (128, 0, 0)
        entries.append((tuple(colours[k]), class_names[k] if k < len(class_names) else f"value {shown}"))
    return entries


def with_captions(
    panels: Sequence[Tensor], captions: Sequence[str], legend: Sequence[tuple[tuple, str]]
) -> Image.Image:
    """``[3, H, W]`` uint8 panels in a row (white gaps), a caption under each, then the legend, on white."""
    height = max(panel.shape[1] for panel in panels)
    swatch = max(SWATCH_PIXELS, round(height * TEXT_HEIGHT_FRACTION))
    row_pixels = swatch + ROW_PIXELS - SWATCH_PIXELS
    font = ImageFont.load_default(size=swatch)
    panel_width = sum(panel.shape[2] for panel in panels) + GAP_PIXELS * (len(panels) - 1)
    entries = list(legend[:MAX_LEGEND_ENTRIES])
    if len(legend) > MAX_LEGEND_ENTRIES:
        entries.append(((255, 255, 255), f"... {len(legend) - MAX_LEGEND_ENTRIES} more classes"))
    # Legend entries in a grid below the captions, each in a cell as wide as the widest, as many a row as fit.
    cell = max((swatch + 4 + int(font.getlength(label)) + 12 for _, label in entries), default=1)
    width = max(panel_width, cell, *(int(font.getlength(caption)) + 4 for caption in captions))
    per_row = width // cell
    canvas = Image.new("RGB", (width, height + row_pixels * (1 + -(-len(entries) // per_row))), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    x = 0
    for panel, caption in zip(panels, captions, strict=True):
        canvas.paste(Image.fromarray(panel.permute(1, 2, 0).numpy()), (x, 0))
        draw.text((x + 2, height + 2), caption, fill=(0, 0, 0), font=font)
        x += panel.shape[2] + GAP_PIXELS
    for index, (colour, label) in enumerate(entries):
        top, x = height + row_pixels * (1 + index // per_row), 2 + cell * (index % per_row)
        draw.rectangle((x, top + 3, x + swatch - 1, top + 2 + swatch), fill=colour, outline=(0, 0, 0))
        draw.text((x + swatch + 4, top + 2), label, fill=(0, 0, 0), font=font)
    return canvas


def find_truth_mask(masks_dir: Path, image_path: Path) -> Path | None:
    """The mask in ``masks_dir`` named like ``image_path`` (``car.jpg`` -> ``car.png``, ``car_mask.gif``, ...)."""
    names = (f"{image_path.stem}{suffix}{extension}" for suffix in TRUTH_SUFFIXES for extension in MASK_FILE_SUFFIXES)
    return next((masks_dir / name for name in names if (masks_dir / name).is_file()), None)


def load_truth_classes(
    masks_dir: Path, image_path: Path, mask_values: Sequence, size: tuple[int, int]
) -> np.ndarray | None:
    """Class indices ``[H, W]`` of the true mask of ``image_path`` in ``masks_dir`` (``find_truth_mask``), resized
    (nearest) to ``size`` = ``(H, W)`` if it differs; None, with a warning, when there is none."""
    mask_path = find_truth_mask(masks_dir, image_path)
    if mask_path is None:
        logger.warning("no true mask for %s in %s; writing the prediction overlay alone", image_path, masks_dir)
        return None
    mask_image = load_image(mask_path)
    if mask_image.size != size[::-1]:
        logger.warning(
            "truth mask %s is %dx%d, image is %dx%d; resizing the mask for display",
            mask_path,
            *mask_image.size,
            *size[::-1],
        )
        mask_image = mask_image.resize(size[::-1], Image.NEAREST)
    return np.asarray(mask_classes(mask_image, 1.0, list(mask_values)), dtype=np.int64)


def render_visualization(
    image: Tensor, predicted: np.ndarray, preprocessing: Preprocessing, truth: np.ndarray | None = None
) -> Image.Image:
    """The prediction overlay, or truth | prediction side by side when ``truth`` is given, captioned, with a legend:
    classes in the colours of the checkpoint's mask values (``class_colours``), labelled by its class names or values.

    The overlay pixels sit at the top left, as in the image (``[:H, :W]``; the prediction's at ``W + GAP_PIXELS``
    beside the truth's); the captions and legend are below them.
    """
    colours = class_colours(preprocessing.mask_values)
    legend = legend_entries(colours, preprocessing.mask_values, preprocessing.class_names)
    predicted_overlay = overlay(image, predicted, colours)
    if truth is None:
        return with_captions([predicted_overlay], CAPTIONS[1:], legend)
    return with_captions([overlay(image, truth, colours), predicted_overlay], CAPTIONS, legend)


def write_prediction(
    item: InputItem, plan: OutputPlan, preprocessing: Preprocessing, config: PredictConfig
) -> str | None:
    """Write one predicted input's files as ``config`` says (--no-save, --viz, the true masks of --masks) with the
    checkpoint's mask values and class names; returns an error message instead of raising (the input's own when it
    could not be read), except for an ``OutputError`` of the output location (see the module docstring)."""
    if item.classes is None:
        return item.error
    try:
        if not config.no_save:
            mask = mask_to_image(item.classes, preprocessing.mask_values)
            write_file(plan.mask, mask.save, f"the mask of {item.path}")
        if config.viz:
            assert item.original is not None
            truth = None
            if config.masks_dir is not None:
                truth = load_truth_classes(config.masks_dir, item.path, preprocessing.mask_values, item.original_size)
            overlay = render_visualization(item.original, item.classes, preprocessing, truth)
            write_file(plan.viz, overlay.save, f"the overlay of {item.path}")
    except (OSError, ValueError, UserError) as error:
        if isinstance(error, OutputError) and error.location_failure:
            raise
        return f"{item.path}: could not write its output: {error}"
    return None


def write_predictions(
    predictions: Generator[InputItem, None, None],
    plans: Sequence[OutputPlan],
    preprocessing: Preprocessing,
    config: PredictConfig,
) -> list[str]:
    """Write every prediction (``write_prediction``) in writer threads; returns the failures (each logged), inputs'
    and writes', after the run's last line (``prediction_summary``).

    At most ``MAX_PENDING_WRITES`` predictions wait for a thread, so a fast model cannot fill memory with them. An
    ``OutputError`` of the output location is raised once the threads stop; writes not yet started are cancelled and
    ``predictions`` is closed (its loader workers stop) so that nothing waits for them.
    """
    failures: list[str] = []
    pending: deque[Future] = deque()

    def collect(future: Future) -> None:
        if (message := future.result()) is not None:
            logger.error("%s", message)
            failures.append(message)

    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="predict-writer")
    try:
        for item in predictions:
            pending.append(pool.submit(write_prediction, item, plans[item.index], preprocessing, config))
            while len(pending) > MAX_PENDING_WRITES:
                collect(pending.popleft())
        while pending:
            collect(pending.popleft())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        predictions.close()
    if failures:
        logger.error("%d of %s failed (named above)", len(failures), count(len(plans), "image"))
    logger.info("%s", prediction_summary(plans, len(failures), config))
    return failures


def prediction_summary(plans: Sequence[OutputPlan], failures: int, config: PredictConfig) -> str:
    """``"Wrote 8 masks and 8 overlays (8 of 8 images) to outputs/demo"``: what was written (as ``config`` says:
    --no-save, --viz) for ``plans`` but ``failures`` of them, and where."""
    written = len(plans) - failures
    kinds = [count(written, noun) for noun, wanted in (("mask", not config.no_save), ("overlay", config.viz)) if wanted]
    names = sorted({str(plan.mask.parent) for plan in plans})
    where = ", ".join(names[:MAX_FOLDERS_NAMED])
    if len(names) > MAX_FOLDERS_NAMED:
        where += f" and {count(len(names) - MAX_FOLDERS_NAMED, 'other folder')}"
    what = " and ".join(kinds) if kinds else "nothing (--no-save without --viz)"
    return f"Wrote {what} ({written} of {count(len(plans), 'image')}) to {where}"


def format_table(result: EvalResult, mask_values: Sequence, class_names: Sequence[str] = ()) -> str:
    """Per-class Dice and IoU and their means as an aligned text table (with a name column when classes have names)."""
    labels = ["class", "mask value", *(["name"] if class_names else [])]
    rows = [[*labels, "Dice", "IoU"]]
    for index, (dice, iou) in enumerate(zip(result.per_class_dice, result.per_class_iou, strict=True)):
        value = mask_values[index] if index < len(mask_values) else "?"
        name = [class_names[index] if index < len(class_names) else ""] if class_names else []
        rows.append([str(index), str(value), *name, f"{dice:.4f}", f"{iou:.4f}"])
    # Macro rows are per-image means; micro rows score the pixels of the whole dataset at once.
    foreground = "mean (classes 1+)" if len(result.per_class_dice) > 1 else "mean"
    for prefix, scores in (("", result.reductions()["macro"]), ("micro ", result.reductions()["micro"])):
        for label, key in ((foreground, ""), ("mean (all classes)", "_with_background")):
            scored = [f"{scores['dice' + key]:.4f}", f"{scores['iou' + key]:.4f}"]
            rows.append([prefix + label, *[""] * (len(labels) - 1), *scored])
    widths = [max(map(len, column)) for column in zip(*rows, strict=True)]
    lines = [
        "  ".join(
            # The text columns left-aligned, the scores right-aligned.
            cell.ljust(width) if column < len(labels) else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
    return "\n".join(lines[:1] + ["-" * len(lines[0])] + lines[1:])


def check_json_path(config: EvaluateConfig) -> None:
    """``--json`` must not replace an image, a mask or a checkpoint (checked before anything runs)."""
    if config.json_path is not None:
        folders = {config.images_dir: "an image in --imgs", config.masks_dir: "a mask in --masks"}
        guard_outputs([(config.json_path, "--json")], config.model, folders, writes_images=False)


def write_json(
    config: EvaluateConfig, result: EvalResult, mask_values: list, scale: float, class_names: tuple[str, ...] = ()
) -> None:
    """The scores as ``--json`` FILE, with what was scored and how."""
    assert config.json_path is not None
    payload = {
        "checkpoint": str(config.model),
        "images": str(config.images_dir),
        "masks": str(config.masks_dir),
        **({"split": str(config.split_path)} if config.split_path is not None else {}),
        "scale": scale,
        "mask_values": mask_values,
        **({"class_names": list(class_names)} if class_names else {}),
        **result.as_dict(),
    }
    write_text(config.json_path, json.dumps(payload, indent=2) + "\n", role="--json")
