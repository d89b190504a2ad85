"""Flow-matching math shared by trainer and engine: ``schedule``, ``step`` (transitions and log-probs equal to
SGLang's), ``forward`` (noising) and ``window`` (stochastic steps; standard library).
"""
