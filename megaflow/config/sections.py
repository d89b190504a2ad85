"""Component settings built from a config section BY FIELD NAME (:func:`from_section` copies every shared field),
so renaming a schema field breaks the build loudly instead of leaving a stale mapping.
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
