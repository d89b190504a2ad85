"""A training run: ``loop`` (the entry on every rank), ``build`` (the one composition root), the algorithm seam
(``algorithm``; one module per algorithm, ``flowgrpo``, ``nft``, over the shared ``requests``), ``roles``, the run
dir and its checkpoints, and the user commands (``export``, ``demo``, ``evaluation``). Importing it imports
nothing: the CLI checks a run dir before anything heavy loads."""
