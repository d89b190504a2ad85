"""The megatron-core trainer: ``runner`` (``Trainer``, ``ReferenceModel``), one update module per algorithm
(``flowgrpo``, ``nft``) over what they share (``batch``), ``shadow`` (weight copies), ``settings`` (config ->
megatron) and ``checkpoint`` (dist-checkpoint save / load with TP/PP resharding)."""
