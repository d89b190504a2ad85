"""First checks on a bare CUDA machine (``scripts/gpu_check.sh``): each check runs in its own process with its
own timeout and reports one JSON record; a check that cannot run here (no CUDA, a package missing) reports
``status: skipped`` with the reason.

- ``run``: the driver (environment record, one subprocess per check, JSON lines, summary table);
- ``model``: megatron SD3 DiT vs diffusers on CUDA (fp32 / bf16, local and TE specs); an SD3.5-Medium-shaped
  training step (time, peak memory) against ``megaflow plan``'s prediction;
- ``comm``: NCCL in a 1-process world (collectives, the distributed bridge); CUDA IPC of bridge buckets to a
  child process (the colocated bridge's path, SGLang left out);
- ``offload``: the SD3.5-Medium-shaped trainer's optimizer states, grad buffers and weights to pinned host memory
  and back (``train.offload``): bytes, seconds, memory freed, exact round trip;
- ``engine``: the SGLang engine on CUDA (tiny SD3: log-probs vs the trainer's recompute, the colocated CUDA-IPC
  sync, release / resume; tiny FLUX in bf16); ``sd35m``: the SD3.5-M RL throughput table (rollout images/s vs
  diffusers, trainer step MFU, whole-loop images/GPU/s of NFT and FlowGRPO, memory per phase vs the plan), its
  arithmetic in ``throughput``;
- ``wheelhouse``: what scripts/gpu_wheels.sh carries and gpu_check.sh installs; ``mirror``: the CPU proof of that
  wheelhouse (scripts/gpu_mirror_check.sh).

Run: ``python -m megaflow.testing.gpu all --out DIR`` (``check NAME`` runs one check in this process).
"""
