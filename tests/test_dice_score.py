"""Dice/IoU maths on hand-made masks with known answers."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from unet import UNet
from utils.evaluation import (
    SegmentationMetrics,
    confusion_counts,
    dice_coeff,
    dice_from_counts,
    dice_loss,
    evaluate_segmentation,
    iou_from_counts,
    multiclass_dice_coeff,
)


def test_dice_coeff_perfect_disjoint_and_empty() -> None:
    mask = torch.zeros(1, 4, 4)
    mask[0, :2] = 1
    assert dice_coeff(mask, mask).item() == pytest.approx(1.0)
    assert dice_coeff(mask, 1 - mask).item() == pytest.approx(0.0, abs=1e-6)
    empty = torch.zeros(1, 4, 4)
    assert dice_coeff(empty, empty).item() == pytest.approx(1.0)


def test_dice_coeff_half_overlap() -> None:
    prediction = torch.tensor([[[1.0, 1.0, 0.0, 0.0]]])
    truth = torch.tensor([[[0.0, 1.0, 1.0, 0.0]]])
    # 2 * 1 / (2 + 2) = 0.5
    assert dice_coeff(prediction, truth).item() == pytest.approx(0.5, abs=1e-6)


def test_reduce_batch_first_counts_the_batch_as_one_volume() -> None:
    prediction = torch.stack([torch.ones(2, 2), torch.zeros(2, 2)])
    truth = torch.stack([torch.ones(2, 2), torch.ones(2, 2)])
    # Per map: 1.0 and 0.0 -> mean 0.5. As one volume: 2*4 / (4 + 8) = 2/3.
    assert dice_coeff(prediction, truth).item() == pytest.approx(0.5, abs=1e-6)
    assert dice_coeff(prediction, truth, reduce_batch_first=True).item() == pytest.approx(2 / 3, abs=1e-6)
    assert dice_loss(prediction, truth).item() == pytest.approx(1 / 3, abs=1e-6)


def test_multiclass_dice_and_loss_of_one_hot_maps() -> None:
    labels = torch.tensor([[[0, 1], [2, 2]]])
    one_hot = torch.nn.functional.one_hot(labels, 3).permute(0, 3, 1, 2).float()
    assert multiclass_dice_coeff(one_hot, one_hot).item() == pytest.approx(1.0)
    assert dice_loss(one_hot, one_hot, multiclass=True).item() == pytest.approx(0.0, abs=1e-6)


def test_dice_coeff_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="differ in shape"):
        dice_coeff(torch.zeros(1, 2, 2), torch.zeros(1, 2, 3))


def test_confusion_counts_by_hand() -> None:
    truth = torch.tensor([[[0, 1, 1, 2]]])
    pred = torch.tensor([[[0, 1, 2, 2]]])
    true_pos, false_pos, false_neg = confusion_counts(pred, truth, n_classes=4)
    assert true_pos.tolist() == [[1, 1, 1, 0]]
    assert false_pos.tolist() == [[0, 0, 1, 0]]
    assert false_neg.tolist() == [[0, 1, 0, 0]]
    dice = dice_from_counts(true_pos, false_pos, false_neg)
    iou = iou_from_counts(true_pos, false_pos, false_neg)
    # Class 3 appears nowhere: it scores 1, not 0 or NaN.
    assert dice[0].tolist() == pytest.approx([1.0, 2 / 3, 2 / 3, 1.0])
    assert iou[0].tolist() == pytest.approx([1.0, 0.5, 0.5, 1.0])


@pytest.mark.parametrize(
    ("pred_fill", "truth_fill", "expected_fg_dice"),
    [(1, 1, 1.0), (0, 1, 0.0), (1, 0, 0.0), (0, 0, 1.0)],  # perfect full, missed, false alarm, empty
)
def test_full_and_empty_masks(pred_fill, truth_fill, expected_fg_dice) -> None:
    metrics = SegmentationMetrics(n_classes=2)
    metrics.update(torch.full((1, 5, 7), pred_fill), torch.full((1, 5, 7), truth_fill))
    result = metrics.compute()
    assert result.dice == pytest.approx(expected_fg_dice)
    assert 0.0 <= min(result.per_class_dice) <= max(result.per_class_dice) <= 1.0


def test_metrics_do_not_depend_on_batching() -> None:
    generator = torch.Generator().manual_seed(0)
    truth = torch.randint(0, 3, (12, 9, 11), generator=generator)
    pred = torch.where(torch.rand(12, 9, 11, generator=generator) < 0.7, truth, torch.randint(0, 3, (12, 9, 11)))
    results = []
    for splits in ([12], [1] * 12, [5, 7], [3, 4, 5]):
        metrics = SegmentationMetrics(n_classes=3)
        for pred_part, truth_part in zip(pred.split(splits), truth.split(splits), strict=True):
            metrics.update(pred_part, truth_part)
        results.append(metrics.compute())
    for result in results[1:]:
        assert result.per_class_dice == pytest.approx(results[0].per_class_dice, abs=1e-12)
        assert result.per_class_iou == pytest.approx(results[0].per_class_iou, abs=1e-12)
    assert 0.0 < results[0].dice < 1.0


def test_empty_metrics_raise() -> None:
    with pytest.raises(ValueError, match="validation set is empty"):
        SegmentationMetrics(n_classes=2).compute()


@pytest.mark.parametrize("n_classes", [1, 3])
def test_evaluate_is_batch_size_invariant_and_keeps_train_mode(n_classes) -> None:
    torch.manual_seed(0)
    model = UNet(3, n_classes, base_channels=8)
    images = torch.rand(6, 3, 24, 20)
    masks = torch.randint(0, max(n_classes, 2), (6, 24, 20))
    dataset = TensorDataset(images, masks)

    def loader(batch_size: int):
        return [{"image": x, "mask": y} for x, y in DataLoader(dataset, batch_size=batch_size)]

    model.train()
    first = evaluate_segmentation(model, loader(1), torch.device("cpu"), n_classes=n_classes, progress=False)
    second = evaluate_segmentation(model, loader(4), torch.device("cpu"), n_classes=n_classes, progress=False)
    assert model.training
    assert first.n_images == second.n_images == 6
    assert first.per_class_dice == pytest.approx(second.per_class_dice, abs=1e-6)
    assert len(first.per_class_dice) == max(n_classes, 2)
    assert 0.0 <= first.dice <= 1.0 and 0.0 <= first.iou <= 1.0
