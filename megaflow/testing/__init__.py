"""Test helpers shared by the test suite and the GPU checks (multi-process harness, reference sampler, probes)."""
from megaflow.testing.dist import RankError, free_port, run_multiprocess

__all__ = ["RankError", "free_port", "run_multiprocess"]
