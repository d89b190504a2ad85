"""``megaflow.json`` beside a megaflow-made pipeline's model_index.json: ``max_sequence_length``
(applied per SGLang request) and ``pretrain`` (recipe and curve of ``megaflow pretrain``).
"""
from __future__ import annotations

import json
from pathlib import Path

META_FILE = "megaflow.json"


def read_meta(pipeline_dir: str | Path) -> dict:
    """The pipeline's ``megaflow.json`` ({} for a pipeline megaflow did not make)."""
    path = Path(pipeline_dir) / META_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def declared_text_len(pipeline_dir: str | Path) -> int | None:
    """The prompt length the pipeline declares, else None (the engine's default)."""
    return read_meta(pipeline_dir).get("max_sequence_length")
