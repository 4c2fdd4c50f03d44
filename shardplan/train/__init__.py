"""Training: the trainer (``python -m shardplan.train``), the optimizer recipe and the demo."""
