"""Training: TFDS/grain data, losses, the trainer, checkpoints."""
