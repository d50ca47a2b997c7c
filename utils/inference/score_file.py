"""evaluate.py's --json: checked before anything runs (it must not replace an input or a checkpoint), written whole."""

from __future__ import annotations

import json
from pathlib import Path

from utils.errors import ConfigError
from utils.evaluation import EvalResult
from utils.inference.config import EvaluateConfig
from utils.inference.file_plan import files_in
from utils.output_files import check_outputs, write_text


def check_json_path(config: EvaluateConfig) -> None:
    """``--json`` must not replace an image, a mask or a checkpoint (checked before anything runs)."""
    if config.json_path is None:
        return
    protected = files_in([config.images_dir], "an image in --imgs")
    protected.update(files_in([config.masks_dir], "a mask in --masks"))
    protected[config.model] = "the checkpoint"
    check_outputs([(config.json_path, "--json")], protected, [config.images_dir, config.masks_dir], writes_images=False)


def write_json(
    path: Path,
    result: EvalResult,
    mask_values: list,
    scale: float,
    config: EvaluateConfig,
    class_names: tuple[str, ...] = (),
) -> None:
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
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"--json {path}: cannot create its folder ({error.strerror or error})") from error
    write_text(path, json.dumps(payload, indent=2) + "\n", role="--json")
