"""Component settings built from a config section BY FIELD NAME: no second set of names.

A component's config dataclass (``AdvantageConfig``, ``LossConfig``, ``MismatchConfig``, ``GRPOSettings``)
names its fields exactly like the schema section it is built from, and :func:`from_section` copies every
field the two share. Renaming a schema field therefore breaks the build loudly instead of leaving a stale
mapping, and the field-coverage test counts a field copied here as read.
"""
from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def from_section(cls: type[T], section: Any, **given: Any) -> T:
    """``cls(**given, **shared)``: ``shared`` = every dataclass field of ``cls`` that ``section`` also has and
    ``given`` does not name, read from ``section`` by that name. ``given`` carries what the section does not
    hold (values from other sections, runtime objects) or holds unresolved (an "auto" 0 the caller resolves)."""
    names = {f.name for f in dataclasses.fields(section)}
    shared = {f.name: getattr(section, f.name) for f in dataclasses.fields(cls)
              if f.name in names and f.name not in given}
    return cls(**shared, **given)
