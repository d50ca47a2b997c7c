"""Inference behind ``predict.py`` and ``evaluate.py``.

``engine`` (the model from its checkpoint, predict's inputs and prediction loop, batches by size, evaluate's mask
values and ``--split``), ``tiling`` (one forward pass, ``--tta`` and sliding windows; whole image or windows by the free
memory), ``writer`` (input files, where outputs go and the one guard of every output, class indices to mask values,
``--viz`` overlays, writer threads and predict's last line, evaluate's table and ``--json``), ``export``
(ONNX/TorchScript) and ``config`` (the two scripts' shared flags and their typed configurations).
"""
