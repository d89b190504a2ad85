"""A training run: ``loop``, ``build`` (the composition root), the algorithm seam and the algorithms' run side,
``roles``, the engine rank's service. Importing it imports nothing: the CLI checks a config before anything heavy.
"""
