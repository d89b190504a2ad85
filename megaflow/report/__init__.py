"""What a person sees of a run: ``progress`` (bar, summary lines, curves, samples), ``metrics`` (metrics.jsonl,
wandb, image grids) and ``plots``."""
