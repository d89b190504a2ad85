"""What the user commands run beyond one training run: ``megaflow demo`` (``demo``), ``megaflow export``
(``export``) and ``megaflow train``'s evaluation hook (``evaluation``); the CLI parses, these do the work.
Importing it imports nothing.
"""
