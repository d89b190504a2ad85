"""Line charts over iterations with matplotlib's object API (no pyplot state): ``line_plot``, ``panel_plot``;
legends below the axes; PNGs written atomically.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

Series = dict[str, list[tuple[float, float]]]
Bands = dict[str, list[tuple[float, float, float]]]
DPI = 100
FLAT_SPAN = 0.05  # a flat series is shown over value ± max(FLAT_SPAN, FLAT_SPAN * |value|)


@dataclass
class Panel:
    """One chart: a line per ``series`` name ((x, y) points), optional shaded bands ((x, lo, hi)) per name."""

    title: str
    series: Series
    bands: Bands = field(default_factory=dict)


def line_plot(series: Series, path: Path, *, title: str, xlabel: str = "iteration", bands: Bands | None = None,
              size=(720, 420)) -> Path:
    """One PNG with one chart (see ``Panel``), ``size`` pixels."""
    return panel_plot([Panel(title, series, bands or {})], path, columns=1, panel_size=size, xlabel=xlabel)


def panel_plot(panels: list[Panel], path: Path, *, columns: int = 3, panel_size=(480, 300),
               xlabel: str = "iteration") -> Path:
    """One PNG with ``panels`` in a grid, ``columns`` per row, each about ``panel_size`` pixels."""
    cols = min(columns, max(1, len(panels)))
    rows = max(1, -(-len(panels) // columns))
    fig = Figure(figsize=(panel_size[0] * cols / DPI, panel_size[1] * rows / DPI), dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    for ax, panel in zip(axes, panels):
        _draw(ax, panel, xlabel)
    for ax in axes[len(panels):]:
        ax.set_axis_off()
    return save_figure(fig, path)


def save_figure(fig: Figure, path: Path) -> Path:
    """Write ``fig`` as a PNG to ``path`` atomically (temporary file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half file behind
        raise
    return path


def _draw(ax, panel: Panel, xlabel: str) -> None:
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ys = []
    for i, (name, pts) in enumerate(panel.series.items()):
        pts = [(x, y) for x, y in pts if math.isfinite(y)]
        color = f"C{i}"
        band = [b for b in panel.bands.get(name, []) if math.isfinite(b[1]) and math.isfinite(b[2])]
        if band:
            ax.fill_between([b[0] for b in band], [b[1] for b in band], [b[2] for b in band], color=color,
                            alpha=0.2, linewidth=0)
            ys += [v for b in band for v in b[1:]]
        ax.plot([x for x, _ in pts], [y for _, y in pts], color=color, label=name, linewidth=1.5,
                marker="o" if len(pts) == 1 else None, markersize=3)  # one point: a dot
        ys += [y for _, y in pts]
    xs = [x for pts in panel.series.values() for x, _ in pts]
    if xs and all(float(x).is_integer() for x in xs):  # iterations: whole-number ticks
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if ys and max(ys) - min(ys) <= 1e-12 * max(1.0, abs(ys[0])):
        half = max(FLAT_SPAN, FLAT_SPAN * abs(ys[0]))
        ax.set_ylim(ys[0] - half, ys[0] + half)
    if panel.series:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=min(3, len(panel.series)), fontsize=7,
                  frameon=False)
