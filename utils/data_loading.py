"""milesial/Pytorch-UNet's import path for the datasets: ``from utils.data_loading import BasicDataset``.

Only re-exports, for code written against milesial's layout; the project itself imports from ``utils.datasets``:
the dataset classes from ``utils.datasets.dataset``, the image preparation inference shares from
``utils.datasets.preparation``.
"""

from utils.datasets.dataset import BasicDataset, CarvanaDataset
from utils.datasets.image_files import IMAGE_EXTENSIONS, load_image
from utils.datasets.mask_values import IGNORE_INDEX
from utils.datasets.pairing import detect_mask_suffix
from utils.datasets.preparation import image_tensor, mask_classes, scaled_size

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
