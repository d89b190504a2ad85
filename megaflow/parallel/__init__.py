"""The parallel layout and the processes: ``dims``, ``placement``, ``distributed``, ``groups`` and the megatron
adaptations. Importing it imports nothing: config checks read ``dims`` and ``placement`` without torch.
"""
