"""Training: configuration, set-up, run state, the loop and its parts."""
