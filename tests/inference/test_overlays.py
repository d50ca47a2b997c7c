"""Overlays for predict.py --viz: colours, what gets painted, truth lookup."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from utils.inference.export import Preprocessing
from utils.inference.writer import (
    GAP_PIXELS,
    OVERLAY_ALPHA,
    PALETTE,
    ROW_PIXELS,
    SWATCH_PIXELS,
    class_colours,
    find_truth_mask,
    inside_edge,
    legend_entries,
    load_truth_classes,
    overlay,
    render_visualization,
)


def test_colour_masks_keep_their_colours_and_grey_masks_get_the_palette():
    assert class_colours([[0, 0, 0], [10, 20, 30]]) == [(0, 0, 0), (10, 20, 30)]
    assert class_colours([0, 255])[1] == PALETTE[0]
    assert len(class_colours([0, 1, 2, 3])) == 4


def test_only_foreground_classes_are_painted():
    image = torch.full((3, 6, 7), 100, dtype=torch.uint8)
    classes = np.zeros((6, 7), dtype=np.uint8)
    classes[1:5, 2:6] = 2
    painted = overlay(image, classes, [(0, 0, 0), (255, 0, 0), (0, 0, 255)])
    changed = (painted != image).any(dim=0).numpy()
    np.testing.assert_array_equal(changed, classes == 2)
    # Inside: half image, half class colour; on the region's edge a white outline (the image is dark).
    red, green, blue = painted[:, 2, 3].tolist()
    assert (red, green) == (50, 50) and blue in (177, 178)
    assert painted[:, 1, 2].tolist() == [255, 255, 255]


def test_the_outline_stands_out_where_the_fill_does_not():
    """A red fill on a maroon car barely changes it; the outline is white there and black on a light car."""
    classes = np.zeros((6, 6), dtype=np.uint8)
    classes[1:5, 1:5] = 1
    for car, outline in (((128, 0, 0), 255), ((230, 230, 230), 0)):
        image = torch.tensor(car, dtype=torch.uint8)[:, None, None].expand(3, 6, 6).contiguous()
        painted = overlay(image, classes, [(0, 0, 0), (200, 0, 0)])
        edge = inside_edge(torch.from_numpy(classes == 1))
        assert edge.sum() == 12 and not edge[2:4, 2:4].any()  # the 4x4 square's ring, not its middle
        assert (painted[:, edge] == outline).all()
        assert (painted[:, ~edge] == overlay_without_outline(image, classes)[:, ~edge]).all()


def overlay_without_outline(image, classes):
    from torchvision.utils import draw_segmentation_masks

    mask = torch.from_numpy(classes == 1)[None]
    return draw_segmentation_masks(image, mask, alpha=OVERLAY_ALPHA, colors=[(200, 0, 0)])


def test_grey_images_are_shown_in_colour():
    image = torch.full((1, 4, 4), 200, dtype=torch.uint8)
    rendered = render_visualization(image, np.zeros((4, 4), dtype=np.uint8), Preprocessing(1.0, [0, 1], 3))
    assert rendered.mode == "RGB"
    assert np.all(np.asarray(rendered)[:4, :4] == 200)


def test_truth_masks_are_found_by_name_and_mapped_to_classes(tmp_path, caplog):
    Image.fromarray(np.array([[0, 255], [255, 0]], dtype=np.uint8)).save(tmp_path / "car_mask.png")
    car = tmp_path / "images" / "car.jpg"
    assert find_truth_mask(tmp_path, car) == tmp_path / "car_mask.png"
    assert find_truth_mask(tmp_path, tmp_path / "bus.jpg") is None
    np.testing.assert_array_equal(load_truth_classes(tmp_path, car, [0, 255], (2, 2)), [[0, 1], [1, 0]])
    # A mask of another size is resized (nearest) to the image's.
    assert load_truth_classes(tmp_path, car, [0, 255], (4, 4)).shape == (4, 4)
    # No mask: the overlay goes alone, with one warning naming the image.
    assert load_truth_classes(tmp_path, tmp_path / "bus.jpg", [0, 255], (2, 2)) is None
    assert f"no true mask for {tmp_path / 'bus.jpg'} in {tmp_path}" in caplog.text


def test_side_by_side_view_has_captions_and_a_legend_of_every_foreground_class():
    image = torch.full((3, 40, 60), 90, dtype=torch.uint8)
    predicted = np.zeros((40, 60), dtype=np.uint8)
    predicted[5:20, 5:30] = 1
    truth = np.zeros((40, 60), dtype=np.uint8)
    truth[10:30, 20:50] = 2
    colours = class_colours([0, 128, 255])
    assert legend_entries(colours, [0, 128, 255]) == [(colours[1], "value 128"), (colours[2], "value 255")]
    rendered = np.asarray(render_visualization(image, predicted, Preprocessing(1.0, [0, 128, 255], 3), truth)).astype(
        int
    )
    # The panels keep the image's pixel positions: truth on the left, prediction right of the gap.
    np.testing.assert_array_equal(np.any(rendered[:40, :60] != 90, axis=-1), truth == 2)
    np.testing.assert_array_equal(
        np.any(rendered[:40, 60 + GAP_PIXELS : 120 + GAP_PIXELS] != 90, axis=-1), predicted == 1
    )
    strip = rendered[40:]
    assert strip.shape[0] >= 2 * ROW_PIXELS
    # Caption text (dark pixels) under each panel, and a swatch of each class colour in the legend.
    assert (strip[:ROW_PIXELS, :60] < 100).all(axis=-1).any() and (strip[:ROW_PIXELS, 68:128] < 100).all(axis=-1).any()
    for colour in colours[1:]:
        assert (strip[ROW_PIXELS:] == colour).all(axis=-1).sum() >= (SWATCH_PIXELS - 2) ** 2


def test_a_legend_wider_than_the_image_widens_the_canvas_instead_of_being_cut():
    image = torch.zeros((3, 8, 8), dtype=torch.uint8)
    rendered = render_visualization(image, np.ones((8, 8), dtype=np.uint8), Preprocessing(1.0, [0, 1], 3))
    assert rendered.width > 8 and rendered.height == 8 + 2 * ROW_PIXELS
