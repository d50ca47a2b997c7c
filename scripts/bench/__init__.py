"""The benchmark's parts, one module per concern; ``scripts/benchmark.py`` parses the flags and runs them.

* ``context``: the settings (``BenchConfig``) and what the sections share while they run (``Context``);
* ``processes``: running a measurement in a child process of its own (threads, time limit, peak RSS, results);
* ``flops``: FLOP counting and the matrix-product peak;
* ``training``: compute-only (the trainer's own ``TrainStep``) and end-to-end ``train.py``, alternating; DDP scaling;
* ``data``: dataset construction, per-item load times, decoders, DataLoader throughput;
* ``demo_data``: the generated data sets the sections run on;
* ``prediction``: ``predict.py`` throughput;
* ``report``: machine facts, the memory rows, the table and the JSON document.
"""
