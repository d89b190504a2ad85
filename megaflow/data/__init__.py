"""Prompt sources: ``prompts`` (a run's prompt pool and its seeded stream) and ``shapes`` (the ShapeEval
grammar: seeded train / held-out prompt sets that parse back into scenes; standard library, so the config
checks read its categories without torch)."""
