"""utils.inference.engine, behind predict.py: batches by size, logits to classes, input decoding, prediction."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers import make_model, reference_classes, write_images
from utils.errors import ConfigError
from utils.hardware import pick_device
from utils.inference.config import PredictConfig, parse_inference_config
from utils.inference.engine import (
    InputItem,
    PredictionInputs,
    batches_by_shape,
    logits_to_classes,
    predict_items,
)
from utils.inference.export import Preprocessing

# Images at half size for an RGB model.
HALF_RGB = Preprocessing(0.5, [0, 1], 3)


def _item(index: int, height: int, width: int) -> InputItem:
    return InputItem(index, Path(f"{index}.png"), torch.zeros(3, height, width), (height, width))


def _batches(items: list[InputItem], batch_size: int, consumed: list[int]):
    """``batches_by_shape`` over ``items``, recording in ``consumed`` the indices it has read so far."""

    def feed():
        for item in items:
            consumed.append(item.index)
            yield item

    return batches_by_shape(feed(), batch_size, lambda item: None if item.error else item.image.shape)


def test_batches_of_one_size_go_as_soon_as_full_even_when_sizes_interleave():
    unreadable = InputItem(3, Path("3.png"), error="cannot read image 3.png")
    consumed = []
    batches = _batches([_item(0, 8, 8), _item(1, 8, 16), unreadable, _item(2, 8, 8), _item(4, 8, 16)], 2, consumed)
    # An unreadable input goes alone, at once; a batch as soon as its size has batch_size images.
    assert next(batches) == [unreadable] and consumed == [0, 1, 3]
    assert [item.index for item in next(batches)] == [0, 2] and consumed == [0, 1, 3, 2]
    assert [item.index for item in next(batches)] == [1, 4]
    assert list(batches) == []


def test_batches_bound_the_number_of_waiting_images():
    consumed = []
    # Every image its own size: without the bound all twelve would wait until the end. At most 4 x 2 wait.
    batches = _batches([_item(index, 8, 8 + index) for index in range(12)], 2, consumed)
    assert [item.index for item in next(batches)] == [0] and len(consumed) == 9
    assert sum(len(batch) for batch in batches) == 11


def test_logits_are_resized_before_the_decision():
    logits = torch.tensor([[[0.0, 1.0]], [[0.5, 0.5]]])  # two classes over a 1x2 image
    classes = logits_to_classes(logits, (1, 4), threshold=0.5)
    # Class 1's logit 0.5 beats class 0's interpolated ramp 0, 0.25 (left half) and loses to 0.75, 1 (right half).
    assert classes.tolist() == [[1, 1, 0, 0]]
    one_logit = torch.tensor([[[-1.0, 1.0]]])
    assert logits_to_classes(one_logit, (1, 2), threshold=0.5).tolist() == [[0, 1]]
    assert logits_to_classes(one_logit, (1, 2), threshold=0.1).tolist() == [[1, 1]]


def test_inputs_decode_resize_and_report_unusable_files_without_raising(tmp_path):
    [good] = write_images(tmp_path, [(64, 48)])
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"\xff\xd8 truncated jpeg")
    grey = tmp_path / "grey.png"
    Image.new("L", (20, 20)).save(grey)
    dataset = PredictionInputs([good, broken, grey, tmp_path / "gone.png"], HALF_RGB, PredictConfig(viz=True))
    item = dataset[0]
    assert item.error is None and item.image.shape == (3, 24, 32) and item.original_size == (48, 64)
    assert item.original.dtype == torch.uint8 and item.original.shape == (3, 48, 64)
    np.testing.assert_array_equal(item.original.permute(1, 2, 0).numpy(), np.asarray(Image.open(good)))
    assert dataset[1].error.startswith(f"cannot read image {broken}")
    # A grey photo for an RGB model is converted (its grey repeated), as training converts it.
    converted = dataset[2]
    assert converted.error is None and converted.converted and converted.image.shape == (3, 10, 10)
    assert torch.equal(converted.image[0], converted.image[2])
    assert dataset[3].error.startswith(f"cannot read image {tmp_path / 'gone.png'}")


def test_a_batch_predicts_what_each_image_alone_gives(tmp_path):
    # Two sizes that shrink to the same network-input size: one batch, two different output sizes.
    paths = write_images(tmp_path, [(64, 48), (65, 49), (64, 48)])
    model = make_model(2)
    dataset = PredictionInputs(paths, HALF_RGB, PredictConfig())
    assert len({tuple(dataset[i].image.shape) for i in range(3)}) == 1
    batches = []
    model.register_forward_hook(lambda module, inputs, output: batches.append(len(inputs[0])))
    config = PredictConfig(batch_size=3, workers=0, no_progress=True)
    predictions = sorted(predict_items(model, dataset, torch.device("cpu"), config), key=lambda item: item.index)
    assert batches == [3]
    for path, prediction in zip(paths, predictions, strict=True):
        assert prediction.classes.shape == (Image.open(path).height, Image.open(path).width)
        np.testing.assert_array_equal(prediction.classes, reference_classes(model, path, 0.5))


def test_unknown_or_absent_devices_are_config_errors():
    # predict.py and evaluate.py resolve --device with utils.hardware.pick_device.
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto").type in ("cpu", "cuda", "mps")
    # A value that is no device is refused where --device is parsed (utils.cli.device_flag), before pick_device.
    with pytest.raises(ConfigError, match="--device: 'warp9' is not a device"):
        parse_inference_config(PredictConfig, "predict.py", ["-i", "a.png", "--device", "warp9"], "a\n\nb")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="--device cuda .*no CUDA device"):
            pick_device("cuda")
