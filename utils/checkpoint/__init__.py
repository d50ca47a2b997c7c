"""Checkpoints: the one file format and everything that writes, reads, chooses and restores them.

* ``format``: the payload's key constants, the inference record, tensor digests, foreign formats (milesial's bare
  ``state_dict``, ``module.`` prefixes, the DDP script's ``model_state_dict``); a resumable run's state
  (``TrainingState``, ``TrainPosition``, the RNG);
* ``files``: atomic writes and the one safe read (``weights_only=True``; ``utils.errors.refused_code``
  names refused code);
* ``model``: the model a file describes (``ModelSpec``, ``load_model``), checked against itself before it is built;
* ``run_folder``: the run folder, its series of reruns, its lock, and which run and file a start continues;
* ``checkpointer``: ``Checkpointer``, the one owner of when a run saves, which files, pruning and the restore.
"""
