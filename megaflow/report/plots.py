"""Small PNG line plots with Pillow (no plotting library in the pinned stack): curves over iterations.

``line_plot`` draws one chart; ``panel_plot`` a grid of ``Panel`` charts in one image. Both write the PNG
atomically (a temporary file in the same directory, then a rename), so a reader never sees half a file.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, ImageDraw

_COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14), (23, 190, 207)]

Series = dict[str, list[tuple[float, float]]]
Bands = dict[str, list[tuple[float, float, float]]]


@dataclass
class Panel:
    """One chart: a line per ``series`` name ((x, y) points), optional shaded bands ((x, lo, hi)) per name."""

    title: str
    series: Series
    bands: Bands = field(default_factory=dict)


def line_plot(series: Series, path: Path, *, title: str, xlabel: str = "iteration", bands: Bands | None = None,
              size=(720, 420)) -> Path:
    """One PNG with one chart (see ``Panel``)."""
    img = Image.new("RGB", size, "white")
    _draw_panel(ImageDraw.Draw(img), (0, 0, *size), Panel(title, series, bands or {}), xlabel)
    return save_png(img, path)


def panel_plot(panels: list[Panel], path: Path, *, columns: int = 3, panel_size=(480, 300),
               xlabel: str = "iteration") -> Path:
    """One PNG with ``panels`` in a grid, ``columns`` per row."""
    w, h = panel_size
    rows = max(1, -(-len(panels) // columns))
    img = Image.new("RGB", (w * min(columns, max(1, len(panels))), h * rows), "white")
    d = ImageDraw.Draw(img)
    for i, panel in enumerate(panels):
        r, c = divmod(i, columns)
        _draw_panel(d, (c * w, r * h, w, h), panel, xlabel)
    return save_png(img, path)


def save_png(img: Image.Image, path: Path) -> Path:
    """Write ``img`` to ``path`` atomically (temporary file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        img.save(tmp, format="PNG")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half file behind
        raise
    return path


def _draw_panel(d: ImageDraw.ImageDraw, box: tuple[int, int, int, int], panel: Panel, xlabel: str) -> None:
    ox, oy, w, h = box
    left, right, top, bottom = 60, 20, 30, 50
    pts = [p for s in panel.series.values() for p in s if math.isfinite(p[1])]
    for b in panel.bands.values():
        pts += [(x, v) for x, lo, hi in b for v in (lo, hi) if math.isfinite(v)]
    d.text((ox + left, oy + 8), panel.title, fill="black")
    if not pts:
        return
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1e-6)
    pad = 0.05 * (y1 - y0)
    y0, y1 = y0 - pad, y1 + pad

    def px(x, y):
        return (ox + left + (x - x0) / (x1 - x0) * (w - left - right),
                oy + top + (y1 - y) / (y1 - y0) * (h - top - bottom))

    d.rectangle([ox + left, oy + top, ox + w - right, oy + h - bottom], outline="black")
    for k in range(5):
        yv = y0 + (y1 - y0) * k / 4
        _, yp = px(x0, yv)
        d.line([ox + left - 4, yp, ox + left, yp], fill="black")
        d.text((ox + 4, yp - 6), f"{yv:.3g}", fill="black")
    ticks = {round(x0 + (x1 - x0) * k / 4) for k in range(5)}
    for xv in sorted(t for t in ticks if x0 <= t <= x1):  # whole numbers inside the axis, each once
        xp, _ = px(xv, y0)
        d.line([xp, oy + h - bottom, xp, oy + h - bottom + 4], fill="black")
        d.text((xp - 10, oy + h - bottom + 8), f"{xv}", fill="black")
    d.text((ox + (w - left) // 2, oy + h - 18), xlabel, fill="black")
    for i, (name, pts_i) in enumerate(panel.series.items()):
        color = _COLORS[i % len(_COLORS)]
        band = panel.bands.get(name)
        if band:
            light = tuple(int(c + (255 - c) * 0.75) for c in color)
            poly = [px(x, hi) for x, lo, hi in band] + [px(x, lo) for x, lo, hi in reversed(band)]
            if len(poly) >= 3:
                d.polygon(poly, fill=light)
        line = [px(x, y) for x, y in pts_i if math.isfinite(y)]
        if len(line) >= 2:
            d.line(line, fill=color, width=2)
        elif line:  # one point: a dot, so a single iteration shows
            (x, y), = line
            d.ellipse([x - 2, y - 2, x + 2, y + 2], fill=color)
        lx, ly = ox + w - right - 200, oy + top + 6 + 14 * i
        d.rectangle([lx - 2, ly - 1, lx + d.textlength(name) + 2, ly + 12], fill="white")  # legend over the lines
        d.text((lx, ly), name, fill=color)
