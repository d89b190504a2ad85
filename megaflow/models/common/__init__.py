"""Pieces shared by the DiT families (``sd3``, ``flux``): config helpers, megatron blocks, layer
specs, the pipeline-stage model base and the generic weight map. Family packages hold only what is theirs.
"""
