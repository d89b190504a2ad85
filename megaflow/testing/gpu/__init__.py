"""First checks on a bare CUDA machine (``scripts/gpu_check.sh``): each check runs in its own process with its
own timeout and reports one JSON record; a check that cannot run here (no CUDA, a package missing) reports
``status: skipped`` with the reason.

Design notes: docs/design/testing.md.
"""
