"""Inference behind ``predict.py`` and ``evaluate.py``.

``engine`` (inputs, size buckets, batched prediction), ``tiling`` (sliding windows), ``file_plan`` (input files,
output paths, writability), ``writer`` (writer threads), ``outputs`` (class indices to mask values), ``overlays``
(``--viz``), ``export`` (ONNX/TorchScript), ``scoring`` (evaluate's masks, batches and table), ``flags`` and
``config`` (the two scripts' shared flags and their typed configurations).
"""
