"""Model families by name: one line per family in ``_FAMILIES``, its card (``megaflow.families.<name>``, the
light part) naming the package of its torch part (``megaflow.models.<name>``, found by
``megaflow.models.registry.get_family``). Invariant: standard library only (config and plan read the cards before
torch loads); nothing outside ``megaflow/models/`` and this package tests a family's name.
"""
from __future__ import annotations

from megaflow.families import flux, qwen_image, sd3, wan
from megaflow.families.card import FamilyCard

_FAMILIES: dict[str, FamilyCard] = {
    "sd3": sd3.CARD,
    "flux": flux.CARD,
    "qwen_image": qwen_image.CARD,
    "wan": wan.CARD,
}
DEFAULT_FAMILY = "sd3"


def family_names() -> tuple[str, ...]:
    """Registered family names, in registration order."""
    return tuple(_FAMILIES)


def card(name: str) -> FamilyCard:
    """The card of family ``name``; ValueError naming it if unknown."""
    if name not in _FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(_FAMILIES)}")
    return _FAMILIES[name]


__all__ = ["DEFAULT_FAMILY", "FamilyCard", "card", "family_names"]
