"""Colour names and how a colour is written in a config (the ``color_target`` reward's ``target``), with the
standard library only, so preflight refuses an unknown colour before anything starts and the reward reads it the
same way (megaflow.rewards.color).
"""
from __future__ import annotations

import re

from megaflow.data.shapes import PALETTE

# ShapeEval's palette plus a few common names, RGB 0-255. Not PIL.ImageColor: these are the values ShapeEval renders
# and checks (PIL's CSS "orange" is (255, 165, 0), ShapeEval's below), and config/ reads this module before any
# third-party import.
COLOR_NAMES: dict[str, tuple[int, int, int]] = {
    **PALETTE,
    "white": (255, 255, 255), "black": (0, 0, 0), "gray": (128, 128, 128), "grey": (128, 128, 128),
    "orange": (245, 130, 30), "pink": (245, 150, 190), "brown": (130, 80, 40),
}


def parse_color(value) -> tuple[float, float, float]:
    """RGB in [0, 1] from a colour name, ``#rrggbb``, or a sequence of 3 floats in [0, 1]; ValueError (one line)
    otherwise."""
    if isinstance(value, str):
        v = value.strip().lower()
        if v in COLOR_NAMES:
            return tuple(c / 255.0 for c in COLOR_NAMES[v])
        if re.fullmatch(r"#[0-9a-f]{6}", v):
            return tuple(int(v[i:i + 2], 16) / 255.0 for i in (1, 3, 5))
        raise ValueError(f"unknown colour {value[:40]!r} (a name in {', '.join(COLOR_NAMES)} or #rrggbb)")
    try:
        rgb = tuple(float(c) for c in value)
    except (TypeError, ValueError):
        rgb = ()
    if len(rgb) != 3 or not all(0.0 <= c <= 1.0 for c in rgb):
        raise ValueError(f"colour must be a name, #rrggbb or 3 floats in [0, 1], got {str(value)[:40]!r}")
    return rgb
