"""``megaflow config keys``: every config field with its type, default, valid range or choices and help, read from
the schema itself (megaflow.config.schema), so the listing cannot drift from what ``load_config`` enforces.
"""
from __future__ import annotations

import dataclasses
import textwrap
from typing import Any

from megaflow.config.load import _field_type, _toml_value
from megaflow.config.schema import MegaflowConfig

_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


@dataclasses.dataclass(frozen=True)
class Key:
    """One config field, as a user writes it: ``section.name = default``."""

    dotted: str
    type: str
    default: Any
    checks: str
    """The valid values: a range (``>= 1, <= 1024``), choices (``one of a, b``), a list's item type, or ""."""
    help: str


def _checks(meta: dict) -> str:
    parts = [f"{sym} {meta[name]}" for name, sym in _BOUNDS if name in meta]
    if "choices" in meta:
        parts.append("one of " + ", ".join(map(str, meta["choices"])))
    if "items" in meta:
        parts.append(f"items: {meta['items'].__name__}")
    return ", ".join(parts)


def config_keys(cfg: MegaflowConfig | None = None) -> list[Key]:
    """Every field of every section, in schema order; defaults from ``cfg`` (default: a fresh config)."""
    cfg = cfg or MegaflowConfig()
    out = []
    for sec in dataclasses.fields(cfg):
        section = getattr(cfg, sec.name)
        for f in dataclasses.fields(section):
            out.append(Key(f"{sec.name}.{f.name}", _field_type(f).__name__, getattr(section, f.name),
                           _checks(f.metadata), f.metadata.get("help", "")))
    return out


def format_keys(keys: list[Key], *, width: int = 100) -> str:
    """One block per key: ``section.key (type) = default  [checks]`` and its help, indented and wrapped."""
    lines = []
    for k in keys:
        lines.append(f"{k.dotted} ({k.type}) = {_toml_value(k.default)}" + (f"  [{k.checks}]" if k.checks else ""))
        lines += textwrap.wrap(k.help, width, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(lines)


def matching(keys: list[Key], words: list[str]) -> list[Key]:
    """The keys whose name or help holds every one of ``words`` (case-insensitive); all with none."""
    words = [w.lower() for w in words]
    return [k for k in keys if all(w in k.dotted.lower() or w in k.help.lower() for w in words)]
