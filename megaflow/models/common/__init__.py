"""Pieces shared by the DiT families (``sd3``, ``flux``): config helpers, megatron building blocks,
layer-spec implementations, the pipeline-stage model base and the generic weight map.

Family packages hold only what is theirs (their diffusers config keys, block wiring, name tables
and fused-tensor recipes); anything two families would otherwise repeat lives here.
"""
