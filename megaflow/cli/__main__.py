"""``python -m megaflow.cli``: the ``megaflow`` command (what torchrun launches on every rank)."""
from megaflow.cli import entry

entry()
