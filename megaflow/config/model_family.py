"""``model.family``'s default when a config leaves it out: the family whose diffusers class the transformer of
``model.pretrained`` names (its ``transformer/config.json``), else the schema's. Invariant: standard library only, and
a config that names ``model.family`` (every saved run's does) is never changed here.
"""
from __future__ import annotations

import json
from pathlib import Path

from megaflow.config.schema import MegaflowConfig
from megaflow.families import card, family_names

MAX_CONFIG_JSON = 1 << 20  # a transformer config.json is a few KB


def infer_family(cfg: MegaflowConfig, explicit: set[str]) -> MegaflowConfig:
    """``cfg`` with ``model.family`` set from ``model.pretrained`` when ``explicit`` (the ``section.field`` names the
    config set) lacks it; an unreadable or unknown transformer config changes nothing (the preflight names it)."""
    if "model.family" in explicit or not cfg.model.pretrained:
        return cfg
    cfg.model.family = pipeline_family(cfg.model.pretrained) or cfg.model.family
    return cfg


def pipeline_family(pipeline_dir: str | Path) -> str | None:
    """The family whose diffusers class the pipeline's ``transformer/config.json`` names; None when it is unreadable
    or names no registered family."""
    path = Path(pipeline_dir) / "transformer" / "config.json"
    try:
        if path.stat().st_size > MAX_CONFIG_JSON:
            return None
        class_name = json.loads(path.read_text(encoding="utf-8")).get("_class_name")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return next((name for name in family_names() if card(name).diffusers_class == class_name), None)
