"""Small PNG line plots with Pillow (no plotting library in the pinned stack): curves over iterations."""
from __future__ import annotations

import math
from pathlib import Path

from PIL import Image, ImageDraw

_COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14), (23, 190, 207)]


def line_plot(series: dict[str, list[tuple[float, float]]], path: Path, *, title: str, xlabel: str = "iteration",
              bands: dict[str, list[tuple[float, float, float]]] | None = None, size=(720, 420)) -> Path:
    """One PNG: a line per ``series`` name ((x, y) points), optional shaded bands ((x, lo, hi)) per name."""
    w, h = size
    left, right, top, bottom = 60, 20, 30, 50
    pts = [p for s in series.values() for p in s if math.isfinite(p[1])]
    for b in (bands or {}).values():
        pts += [(x, v) for x, lo, hi in b for v in (lo, hi) if math.isfinite(v)]
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    d.text((left, 8), title, fill="black")
    if not pts:
        img.save(path)
        return Path(path)
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1e-6)
    pad = 0.05 * (y1 - y0)
    y0, y1 = y0 - pad, y1 + pad

    def px(x, y):
        return left + (x - x0) / (x1 - x0) * (w - left - right), top + (y1 - y) / (y1 - y0) * (h - top - bottom)

    d.rectangle([left, top, w - right, h - bottom], outline="black")
    for k in range(5):
        yv = y0 + (y1 - y0) * k / 4
        _, yp = px(x0, yv)
        d.line([left - 4, yp, left, yp], fill="black")
        d.text((4, yp - 6), f"{yv:.3g}", fill="black")
        xv = x0 + (x1 - x0) * k / 4
        xp, _ = px(xv, y0)
        d.line([xp, h - bottom, xp, h - bottom + 4], fill="black")
        d.text((xp - 10, h - bottom + 8), f"{xv:.0f}", fill="black")
    d.text(((w - left) // 2, h - 18), xlabel, fill="black")
    for i, (name, pts_i) in enumerate(series.items()):
        color = _COLORS[i % len(_COLORS)]
        band = (bands or {}).get(name)
        if band:
            light = tuple(int(c + (255 - c) * 0.75) for c in color)
            poly = [px(x, hi) for x, lo, hi in band] + [px(x, lo) for x, lo, hi in reversed(band)]
            if len(poly) >= 3:
                d.polygon(poly, fill=light)
        line = [px(x, y) for x, y in pts_i if math.isfinite(y)]
        if len(line) >= 2:
            d.line(line, fill=color, width=2)
        d.text((w - right - 200, top + 6 + 14 * i), name, fill=color)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return Path(path)
