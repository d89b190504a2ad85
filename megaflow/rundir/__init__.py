"""A run's bookkeeping on disk and at its edges: the run directory's claim (``claim``), the checkpoint layout
(``checkpoints``) and its saving / loading (``checkpoint_io``), ``eval.jsonl`` (``eval_log``), stopping at an
iteration boundary on a signal (``interrupt``) and the crash points of the resume tests (``faults``).
Importing it imports nothing; ``claim``, ``checkpoints`` and ``interrupt`` need only the standard library (and
psutil), so the CLI refuses a bad run dir or checkpoint before anything heavy loads.
"""
