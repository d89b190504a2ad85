"""What a person sees of a run: ``progress`` (bar, summary lines, curves, samples), ``metrics`` (metrics.jsonl,
the metrics backends of ``backends``: W&B, TensorBoard; image grids) and ``plots``."""
