"""Inference behind ``predict.py`` and ``evaluate.py``.

``engine`` (predict's model from its checkpoint, inputs, batches by size, the prediction loop), ``tiling`` (one
forward pass, ``--tta`` and sliding windows; whole image or windows by the free memory), ``file_plan`` (input files,
output paths, writability), ``writer`` (class indices to mask values, ``--viz`` overlays, writer threads and the run's
last line), ``export`` (ONNX/TorchScript), ``scoring`` (evaluate's masks, batches, table and ``--json``), ``flags``
and ``config`` (the two scripts' shared flags and their typed configurations).
"""
