"""First checks on a bare CUDA machine (``scripts/gpu_check.sh``): each check runs in its own process with its
own timeout and reports one JSON record; a check that cannot run here (no CUDA, a package missing) reports
``status: skipped`` with the reason.

- ``run``: the driver (environment record, one subprocess per check, JSON lines, summary table);
- ``model``: megatron SD3 DiT vs diffusers on CUDA (fp32 / bf16, local and TE specs); an SD3.5-Medium-shaped
  training step (time, peak memory) against ``megaflow plan``'s prediction;
- ``comm``: NCCL in a 1-process world (collectives, the distributed bridge); CUDA IPC of bridge buckets to a
  child process (the colocated bridge's path, SGLang left out);
- ``offload``: the SD3.5-Medium-shaped trainer's optimizer states, grad buffers and weights to pinned host memory
  and back (``train.offload``): bytes, seconds, memory freed, exact round trip.

Run: ``python -m megaflow.testing.gpu all --out DIR`` (``check NAME`` runs one check in this process).
"""
