"""Data: image files, mask values, augmentation, demo data."""
