"""milesial/Pytorch-UNet's import path for the datasets: ``from utils.data_loading import BasicDataset``.

Only re-exports, for code written against milesial's layout; the project itself imports from ``utils.datasets``:
the dataset classes and the image preparation inference shares from ``utils.datasets.dataset``.
"""

from utils.datasets.dataset import BasicDataset, CarvanaDataset, image_tensor, mask_classes, scaled_size
from utils.datasets.image_files import IMAGE_EXTENSIONS, detect_mask_suffix, load_image
from utils.datasets.mask_values import IGNORE_INDEX

__all__ = [
    "IMAGE_EXTENSIONS",
    "BasicDataset",
    "IGNORE_INDEX",
    "CarvanaDataset",
    "detect_mask_suffix",
    "image_tensor",
    "load_image",
    "mask_classes",
    "scaled_size",
]
