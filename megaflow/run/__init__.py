"""A training run: ``loop``, ``build`` (the composition root), the algorithm seam, ``roles``, the run dir,
checkpoints and the user commands. Importing it imports nothing: the CLI checks a run dir before anything heavy.
"""
