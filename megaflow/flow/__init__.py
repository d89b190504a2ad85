"""Flow-matching math shared by the trainer and the engine: ``schedule`` (sigma grids), ``step`` (one-step
transitions and their log-probs: pure functions of tensors, no scheduler state, the numbers equal SGLang's
rollout and diffusers' grids), ``forward`` (the noising process and the matching error of the algorithms that
train on clean samples) and ``window`` (which steps are stochastic; standard library, so config checks
read it without torch).
"""
