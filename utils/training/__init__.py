"""Training: configuration, set-up, the loop and its parts (checkpoints: ``utils.checkpoint``)."""
