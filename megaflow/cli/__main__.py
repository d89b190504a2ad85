"""``python -m megaflow.cli``: the ``megaflow`` command (what torchrun launches on every rank)."""
import sys

from megaflow.cli import main

sys.exit(main())
