"""The typed configurations of ``predict.py`` and ``evaluate.py``, each validated once, up front."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from utils.errors import ConfigError
from utils.inference.file_plan import MASK_FORMATS
from utils.inference.flags import check_compute_flags
from utils.inference.tiling import TileSettings

# Probability above which a one-logit model's pixel is foreground (milesial's -t default).
DEFAULT_MASK_THRESHOLD = 0.5


@dataclass
class PredictConfig:
    """Everything ``predict.py`` needs, validated once by ``validate``."""

    model: Path = Path("MODEL.pth")
    """Checkpoint: ours, a milesial state_dict with ``mask_values``, or a DDP ``module.``-prefixed one."""
    inputs: list[str] = field(default_factory=list)
    """Image files, folders (their supported images, not recursive) or glob patterns."""
    outputs: list[Path] | None = None
    """One output file per input file; default ``<name>_OUT.png`` beside each input or in ``output_dir``."""
    output_dir: Path | None = None
    viz: bool = False
    """Write ``<name>_VIZ.png``: the prediction over the image (truth | prediction with ``masks_dir``)."""
    masks_dir: Path | None = None
    no_save: bool = False
    mask_threshold: float = DEFAULT_MASK_THRESHOLD
    scale: float | None = None
    """Resize factor; None: the checkpoint's training scale (``utils.checkpoint.model.resolve_scale``)."""
    bilinear: bool = False
    """milesial's flag; the checkpoint decides the architecture, a contradicting flag is an error."""
    classes: int | None = None
    """milesial's flag; the checkpoint decides the architecture, a contradicting flag is an error."""
    batch_size: int = 4
    precision: str = "fp32"
    device: str = "auto"
    workers: int = 2
    pixel_cache: Path | None = None
    """--pixel-cache: read (and fill) the decoded, resized inputs there, as training's --pixel-cache does."""
    tile: int | None = None
    tile_overlap: float = 0.5
    """Fraction shared by neighbouring windows; 0.5 is nnU-Net's step of half a window."""
    tta: bool = False
    """Average the logits of the image and its flips (4 passes)."""
    export_format: str | None = None
    export_path: Path | None = None
    export_size: tuple[int, int] = (256, 256)
    """``(height, width)`` of the sample input used for ``--export``."""
    progress: bool = True

    def validate(self) -> None:
        if not self.inputs and self.export_format is None:
            raise ConfigError("no input given: pass images with --input/-i (or use --export FORMAT PATH)")
        check_compute_flags(self.scale, self.batch_size, self.workers, workers_job="decode")
        if not 0.0 <= self.mask_threshold <= 1.0:
            raise ConfigError(f"--mask-threshold {self.mask_threshold}: use a probability in [0, 1]")
        if self.classes is not None and self.classes < 1:
            raise ConfigError(f"--classes {self.classes}: use 1 (binary, one logit) or more")
        if self.no_save and not self.viz:
            raise ConfigError("--no-save with no --viz would write nothing; drop --no-save or add --viz")
        if self.outputs is not None and self.output_dir is not None:
            raise ConfigError("give either --output/-o (one file per input) or --output-dir, not both")
        for output in self.outputs or []:
            if output.suffix.lower() not in MASK_FORMATS:
                raise ConfigError(f"--output {output}: masks must be lossless, use one of {', '.join(MASK_FORMATS)}")
        if self.masks_dir is not None and not self.masks_dir.is_dir():
            raise ConfigError(f"--masks {self.masks_dir} is not a folder")
        if self.masks_dir is not None and not self.viz:
            raise ConfigError("--masks only feeds the --viz side-by-side view; add --viz")
        self.tile_settings()

    def tile_settings(self) -> TileSettings | None:
        """The ``--tile`` window settings (checked on creation), or None without ``--tile``."""
        return None if self.tile is None else TileSettings(self.tile, self.tile_overlap, self.tta)


@dataclass
class EvaluateConfig:
    """Everything ``evaluate.py`` needs, validated once by ``validate``."""

    model: Path
    images_dir: Path
    masks_dir: Path
    scale: float | None = None
    """Resize factor of images and masks, in (0, 1]; None: the checkpoint's training scale."""
    batch_size: int = 4
    """Images per forward pass; images of different sizes go into different batches."""
    precision: str = "fp32"
    device: str = "auto"
    workers: int = 2
    json_path: Path | None = None
    """Also write the scores as JSON here."""
    split_path: Path | None = None
    """A run's ``split.json``: score only its validation images (``utils.datasets.splits``)."""
    bilinear: bool = False
    """milesial's flag; the checkpoint decides the architecture, a contradicting flag is an error."""
    classes: int | None = None
    """milesial's flag; the checkpoint decides the architecture, a contradicting flag is an error."""
    progress: bool = True

    def validate(self) -> None:
        check_compute_flags(self.scale, self.batch_size, self.workers, workers_job="load")
