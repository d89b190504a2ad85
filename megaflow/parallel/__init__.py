"""The parallel layout and the processes: ``dims`` (ParallelDims: the layout and its rules; standard library),
``placement`` (which ranks train and which host engines; standard library), ``distributed`` (torch.distributed +
megatron parallel_state), ``groups`` (megaflow's own process groups on the launch's store) and the CPU / perf
adaptations of megatron-core (``cpu``, ``perf_patches``, ``patching``, ``sp_norm``).

Importing this package imports nothing: config checks read ``dims`` and ``placement`` without torch."""
