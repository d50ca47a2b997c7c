"""Inference behind ``predict.py`` and ``evaluate.py``.

``engine`` (predict's model from its checkpoint, inputs, size buckets, batched prediction), ``tiling`` (one forward
pass, ``--tta`` and sliding windows), ``memory`` (whole image or windows), ``file_plan`` (input files, output paths,
writability), ``writer`` (writer threads and the run's last line), ``outputs`` (class indices to mask values),
``overlays`` (``--viz``), ``export`` (ONNX/TorchScript), ``scoring`` (evaluate's masks, batches, table and
``--json``), ``flags`` and ``config`` (the two scripts' shared flags and their typed configurations).
"""
