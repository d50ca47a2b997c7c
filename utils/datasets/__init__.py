"""Data: the datasets and the image preparation shared with inference (``dataset``), image files, their naming and
pairing (``image_files``), mask values, splits, the dataset check, the pixel cache, augmentation, demo data."""
