"""First checks on a bare CUDA machine (``scripts/gpu_check.sh``): each check in its own process and timeout,
one JSON record each; one that cannot run here reports ``status: skipped``. Design notes: docs/design/testing.md.
"""
