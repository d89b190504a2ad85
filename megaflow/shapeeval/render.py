"""Ground-truth renderer for ShapeEval scenes (relations hold under the checker's own predicate), plus
corruptions for testing the checker. Design notes: docs/design/shapeeval.md.
"""
from __future__ import annotations

import dataclasses
import random

import numpy as np
from PIL import Image, ImageDraw

from megaflow.data.shapes import (BACKGROUND, MAX_COUNT, PALETTE, RELATIONS, SHAPES, Scene,
                                  parse_prompt, relation_holds)

CORRUPTIONS: tuple[str, ...] = ("color", "count", "position", "shape")
_OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
_MAX_RESTARTS = 400


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlacedObject:
    """An object's square bounding box (top-left ``x0, y0``, side ``size``) in output pixels."""

    shape: str
    color: str
    group: int
    x0: int
    y0: int
    size: int


def size_range(resolution: int, num_objects: int) -> tuple[int, int]:
    """Object side range in pixels: 22%-30% of the image (26% when crowded), at least 5 px (a
    smaller circle is a square with its corners cut)."""
    lo = max(5, round(0.22 * resolution))
    hi = round((0.30 if num_objects <= 2 else 0.26) * resolution)
    return lo, max(lo, hi)


def _draw(draw: ImageDraw.ImageDraw, obj: PlacedObject, fill, scale: int) -> None:
    x0, y0, s = obj.x0 * scale, obj.y0 * scale, obj.size * scale
    x1, y1 = x0 + s - 1, y0 + s - 1
    if obj.shape == "circle":
        draw.ellipse([x0, y0, x1, y1], fill=fill)
    elif obj.shape == "square":
        draw.rectangle([x0, y0, x1, y1], fill=fill)
    elif obj.shape == "triangle":
        draw.polygon([(x0 + (s - 1) / 2, y0), (x0, y1), (x1, y1)], fill=fill)
    else:
        raise ValueError(f"unknown ShapeEval shape: {obj.shape!r} (known: {', '.join(SHAPES)})")


def _centroid(obj: PlacedObject, resolution: int) -> tuple[float, float]:
    """Centroid (x, y) of the object's hard mask at the output resolution."""
    mask = Image.new("L", (resolution, resolution), 0)
    _draw(ImageDraw.Draw(mask), obj, 255, 1)
    ys, xs = np.nonzero(np.asarray(mask))
    return float(xs.mean()), float(ys.mean())


def _regions(scene: Scene, resolution: int, rng: random.Random, gap: int) -> list[tuple[int, int, int, int]]:
    """Allowed box (x0, y0, x1, y1), exclusive end, per group: the whole canvas, or the two sides
    of a random split line for a relation."""
    full = (1, 1, resolution - 1, resolution - 1)
    if scene.relation is None:
        return [full] * len(scene.groups)
    split = rng.randint(round(0.38 * resolution), round(0.62 * resolution))
    lo_side, hi_side = split - gap // 2, split + (gap - gap // 2)
    horizontal = scene.relation in ("left of", "right of")
    if horizontal:
        first, second = (1, 1, lo_side, resolution - 1), (hi_side, 1, resolution - 1, resolution - 1)
    else:
        first, second = (1, 1, resolution - 1, lo_side), (1, hi_side, resolution - 1, resolution - 1)
    if scene.relation in ("left of", "above"):
        return [first, second]
    return [second, first]


def _separated(a: PlacedObject, b: PlacedObject, gap: int) -> bool:
    return (a.x0 + a.size + gap <= b.x0 or b.x0 + b.size + gap <= a.x0
            or a.y0 + a.size + gap <= b.y0 or b.y0 + b.size + gap <= a.y0)


def _try_place(scene: Scene, colors: list[str], resolution: int, rng: random.Random,
               shrink: int) -> list[PlacedObject] | None:
    """One placement attempt; None if some object did not fit or a relation failed."""
    gap = max(2, round(0.06 * resolution))
    lo, hi = size_range(resolution, scene.num_objects)
    hi = max(lo, hi - shrink)
    regions = _regions(scene, resolution, rng, gap)
    placed: list[PlacedObject] = []
    for gi, group in enumerate(scene.groups):
        rx0, ry0, rx1, ry1 = regions[gi]
        for _ in range(group.count):
            size = rng.randint(lo, hi)
            if rx1 - rx0 < size or ry1 - ry0 < size:
                return None
            for _ in range(40):
                obj = PlacedObject(shape=group.shape, color=colors[gi], group=gi, size=size,
                                   x0=rng.randint(rx0, rx1 - size), y0=rng.randint(ry0, ry1 - size))
                if all(_separated(obj, p, gap) for p in placed):
                    placed.append(obj)
                    break
            else:
                return None
    if scene.relation is not None:
        cents = [_centroid(o, resolution) for o in placed]
        pairs = [(cents[i], cents[j]) for i, a in enumerate(placed) for j, b in enumerate(placed)
                 if a.group == 0 and b.group == 1]
        if not all(relation_holds(ca, cb, scene.relation, resolution, slack=1.0) for ca, cb in pairs):
            return None
    return placed


def place_objects(scene: Scene, *, resolution: int, rng: random.Random) -> list[PlacedObject]:
    """Random sizes/positions satisfying the scene; colour-free groups get one random palette
    colour each. Raises RuntimeError if no layout is found (scene too crowded for the resolution)."""
    colors = [g.color or rng.choice(list(PALETTE)) for g in scene.groups]
    for attempt in range(_MAX_RESTARTS):
        placed = _try_place(scene, colors, resolution, rng, shrink=attempt // 50)
        if placed is not None:
            return placed
    raise RuntimeError(f"could not lay out {scene.prompt!r} at {resolution}px")


def render_objects(objects: list[PlacedObject], *, resolution: int, supersample: int = 1,
                   background: tuple[int, int, int] = BACKGROUND) -> np.ndarray:
    """Draw objects as uint8 [H, W, 3]; ``supersample`` > 1 draws k-times larger and box-filters
    down (anti-aliased edges)."""
    big = resolution * supersample
    img = Image.new("RGB", (big, big), background)
    draw = ImageDraw.Draw(img)
    for obj in objects:
        _draw(draw, obj, PALETTE[obj.color], supersample)
    if supersample > 1:
        img = img.resize((resolution, resolution), Image.BOX)
    return np.asarray(img, dtype=np.uint8).copy()


def render_scene(scene: Scene, *, resolution: int = 32, rng: random.Random | int = 0,
                 supersample: int = 1) -> np.ndarray:
    """A ground-truth uint8 [H, W, 3] image matching ``scene``."""
    if resolution < 16:
        raise ValueError(f"ShapeEval resolution must be >= 16, got {resolution}")
    rng = rng if isinstance(rng, random.Random) else random.Random(rng)
    objects = place_objects(scene, resolution=resolution, rng=rng)
    return render_objects(objects, resolution=resolution, supersample=supersample)


def render_prompts(prompts: list[str], *, resolution: int = 32, seed: int = 0,
                   supersample: int = 1) -> np.ndarray:
    """Ground-truth images for prompts, uint8 [B, H, W, 3]; deterministic in ``seed``."""
    rng = random.Random(seed)
    return np.stack([render_scene(parse_prompt(p), resolution=resolution, rng=rng, supersample=supersample)
                     for p in prompts])


def corrupt_scene(scene: Scene, kind: str, rng: random.Random) -> Scene | None:
    """A scene differing from ``scene`` in one ``kind`` (color, count, position, shape), so its rendering must fail
    ``scene.prompt``; None when the kind does not apply."""
    groups = list(scene.groups)
    if kind == "color":
        idx = [i for i, g in enumerate(groups) if g.color]
        if not idx:
            return None
        i = rng.choice(idx)
        new = rng.choice([c for c in PALETTE if c != groups[i].color])
        groups[i] = dataclasses.replace(groups[i], color=new)
    elif kind == "count":
        if scene.num_objects >= MAX_COUNT:  # full scene: remove one object from a multi-object group
            i = rng.choice([i for i, g in enumerate(groups) if g.count > 1])
            delta = -1
        else:
            i = rng.randrange(len(groups))
            delta = 1 if groups[i].count == 1 else rng.choice((-1, 1))
        groups[i] = dataclasses.replace(groups[i], count=groups[i].count + delta)
    elif kind == "position":
        if scene.relation is None:
            return None
        return dataclasses.replace(scene, relation=_OPPOSITE[scene.relation])
    elif kind == "shape":
        i = rng.randrange(len(groups))
        taken = {g.shape for g in groups}
        choices = [s for s in SHAPES if s not in taken] or [s for s in SHAPES if s != groups[i].shape]
        groups[i] = dataclasses.replace(groups[i], shape=rng.choice(choices))
    else:
        raise ValueError(f"unknown corruption: {kind!r} (known: {', '.join(CORRUPTIONS)})")
    return dataclasses.replace(scene, groups=tuple(groups))


assert set(_OPPOSITE) == set(RELATIONS)
