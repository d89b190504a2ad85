"""A training run: ``loop`` (the entry on every rank and the FlowGRPO loop), ``build`` (the one composition root),
``roles``, ``engine_rank``, ``flowgrpo``, ``phases``, the run dir and its checkpoints (``rundir``, ``checkpoints``,
``state``), ``interrupt``, ``faults``, ``export`` and ``demo``. Importing it imports nothing: the CLI checks a run
dir before anything heavy loads."""
