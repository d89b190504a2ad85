"""Test helpers shared by the test suite (multi-process harness)."""
from megaflow.testing.dist import RankError, free_port, run_multiprocess

__all__ = ["RankError", "free_port", "run_multiprocess"]
