"""Data: the datasets (``dataset``), mask naming and pairing (``pairing``), image preparation shared with inference
(``preparation``), image files, mask values, the pixel cache, augmentation, demo data."""
