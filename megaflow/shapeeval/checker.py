"""Deterministic pixel-level ShapeEval checker: find the objects in an image, judge a scene.

Design notes: docs/design/shapeeval.md.
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from megaflow.shapeeval.render import size_range
from megaflow.data.shapes import BACKGROUND, PALETTE, Group, Scene, category_of, relation_holds

_PALETTE_NAMES = tuple(PALETTE)
_PALETTE_RGB = np.array([PALETTE[c] for c in _PALETTE_NAMES], dtype=np.float32)
_OFF_PALETTE = len(_PALETTE_NAMES) + 1  # pixel class after background (0) and palette (1..P)
# (fill ratio, 2 * (vertical centroid offset within the box - 0.5), half the filled fraction of
# the box's 4 corner pixels) per shape.
_PROTOTYPES = {"square": (1.0, 0.0, 0.5), "circle": (0.77, 0.0, 0.0), "triangle": (0.53, 0.31, 0.25)}
_MAX_PROTOTYPE_DIST = 0.3
_NEIGHBOURS = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if (dy, dx) != (0, 0)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DetectedObject:
    """One connected component: ``color``/``shape`` None when off-palette / unrecognised."""

    color: str | None
    shape: str | None
    area: int
    centroid: tuple[float, float]  # (x, y) pixels, y downwards
    bbox: tuple[int, int, int, int]  # x0, y0, x1, y1 inclusive


@dataclasses.dataclass(frozen=True, kw_only=True)
class SceneScore:
    """Verdict on one image: exact pass, graded partial score in [0, 1], and the category."""

    passed: bool
    partial: float
    category: str
    num_extra: int


def _label_components(classes: np.ndarray) -> np.ndarray:
    """8-connected component ids (flat index of a member pixel) per pixel; -1 on background
    (class 0). Vectorised min-label propagation with pointer jumping."""
    h, w = classes.shape
    big = h * w
    fg = classes > 0
    comp = np.where(fg, np.arange(big).reshape(h, w), big)
    pad_cls = np.pad(classes, 1, constant_values=0)
    while True:
        pad = np.pad(comp, 1, constant_values=big)
        new = comp.copy()
        for dy, dx in _NEIGHBOURS:
            nb = pad[1 + dy:1 + dy + h, 1 + dx:1 + dx + w]
            same = pad_cls[1 + dy:1 + dy + h, 1 + dx:1 + dx + w] == classes
            new = np.minimum(new, np.where(same & fg, nb, big))
        flat = new.ravel()
        flat[fg.ravel()] = flat[flat[fg.ravel()]]  # pointer jumping: follow the label once
        new = flat.reshape(h, w)
        if np.array_equal(new, comp):
            return np.where(fg, comp, -1)
        comp = new


def _classify_shape(mask: np.ndarray) -> str | None:
    """Nearest shape prototype for a component mask cropped to its bounding box."""
    h, w = mask.shape
    if max(h, w) > 1.8 * min(h, w):
        return None
    fill = float(mask.mean())
    ys = np.nonzero(mask)[0]
    offset = 2.0 * ((ys.mean() + 0.5) / h - 0.5)
    corners = 0.5 * float(mask[[0, 0, -1, -1], [0, -1, 0, -1]].mean())
    feats = np.array([fill, offset, corners])
    dists = {s: float(np.linalg.norm(feats - np.array(p))) for s, p in _PROTOTYPES.items()}
    shape = min(dists, key=dists.get)
    return shape if dists[shape] <= _MAX_PROTOTYPE_DIST else None


def default_tolerance() -> float:
    """Colour tolerance: 40% of the smallest distance between palette colours and the background."""
    cands = np.concatenate([_PALETTE_RGB, np.array([BACKGROUND], dtype=np.float32)])
    d = np.linalg.norm(cands[:, None] - cands[None], axis=-1)
    return 0.4 * float(d[d > 0].min())


def _background(px: np.ndarray, tol: float) -> np.ndarray | None:
    """Median colour of the one-pixel border, or None when under half the border is within
    ``tol`` of it (no uniform background, e.g. noise: then every pixel is off-palette)."""
    border = np.concatenate([px[0], px[-1], px[:, 0], px[:, -1]])
    bg = np.median(border, axis=0)
    if np.mean(np.linalg.norm(border - bg, axis=-1) <= tol) < 0.5:
        return None
    return bg


def _classify_pixels(px: np.ndarray, tol: float) -> np.ndarray:
    """Class per pixel (0 background, 1..P palette, P+1 off-palette), each pixel read as a blend ``bg + a * (colour
    - bg)``: the closest colour within ``tol``, object when ``a >= 0.5``."""
    bg = _background(px, tol)
    if bg is None:
        return np.full(px.shape[:2], _OFF_PALETTE, dtype=np.int64)
    seg = _PALETTE_RGB - bg  # [P, 3]
    rel = px - bg  # [H, W, 3]
    dot, seg_sq = rel @ seg.T, (seg * seg).sum(-1)  # [H, W, P], [P]
    alpha = np.clip(dot / np.maximum(seg_sq, 1e-6), 0.0, 1.0)
    rel_sq = (rel * rel).sum(-1, keepdims=True)
    resid_sq = rel_sq - 2.0 * alpha * dot + alpha * alpha * seg_sq  # |rel - alpha * seg|^2
    best = resid_sq.argmin(-1)
    best_alpha = np.take_along_axis(alpha, best[..., None], -1)[..., 0]
    on_palette = resid_sq.min(-1) <= tol * tol
    near_bg = rel_sq[..., 0] <= tol * tol
    inside = np.where(best_alpha >= 0.5, best + 1, 0)
    classes = np.where(on_palette, inside, np.where(near_bg, 0, _OFF_PALETTE))
    return classes.astype(np.int64)


def detect_objects(image: np.ndarray, *, tolerance: float | None = None,
                   min_area: int | None = None) -> list[DetectedObject]:
    """Objects in a uint8 [H, W, 3] image (see the module's design notes). ``min_area`` defaults to 20%
    of the smallest rendered object's box at this resolution."""
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"ShapeEval checker wants uint8 [H, W, 3], got {image.dtype} {tuple(image.shape)}")
    h, w, _ = image.shape
    tol = default_tolerance() if tolerance is None else tolerance
    if min_area is None:
        lo, _ = size_range(min(h, w), 1)
        min_area = max(4, round(0.2 * lo * lo))
    classes = _classify_pixels(image.astype(np.float32), tol)
    comp = _label_components(classes)
    objects = []
    for cid in np.unique(comp[comp >= 0]):
        ys, xs = np.nonzero(comp == cid)
        if len(ys) < min_area:
            continue
        cls = int(classes[ys[0], xs[0]])
        x0, x1, y0, y1 = int(xs.min()), int(xs.max()), int(ys.min()), int(ys.max())
        mask = comp[y0:y1 + 1, x0:x1 + 1] == cid
        objects.append(DetectedObject(
            color=None if cls == _OFF_PALETTE else _PALETTE_NAMES[cls - 1],
            shape=_classify_shape(mask), area=int(len(ys)),
            centroid=(float(xs.mean()), float(ys.mean())), bbox=(x0, y0, x1, y1)))
    return objects


def _ratio(found: int, wanted: int) -> float:
    return 0.0 if found == 0 else min(found, wanted) / max(found, wanted)


def matches(o: DetectedObject, g: Group) -> bool:
    """Whether a detected object is one of group ``g``'s: its shape and colour (off-palette blobs never match,
    even "any colour")."""
    return o.color is not None and o.shape == g.shape and (g.color is None or o.color == g.color)


def score_objects(objects: list[DetectedObject], scene: Scene, resolution: int) -> SceneScore:
    """Judge detected objects against a scene. Partial score = mean over groups of a count score
    (matching shape and colour; for coloured groups averaged with a shape-only count, so a wrong
    colour earns half) and, with a relation, the fraction of group-0 x group-1 pairs that satisfy
    it; times n_expected / (n_expected + n_unclaimed)."""
    matched = [[o for o in objects if matches(o, g)] for g in scene.groups]
    claimed = {id(o) for group_objs in matched for o in group_objs}
    parts, exact = [], True
    for g, objs in zip(scene.groups, matched):
        count_score = _ratio(len(objs), g.count)
        exact &= len(objs) == g.count
        if g.color is not None:
            others = {id(o) for k, objs_k in enumerate(matched) if objs_k is not objs for o in objs_k}
            same_shape = [o for o in objects if o.color is not None and o.shape == g.shape
                          and id(o) not in others]
            count_score = 0.5 * (count_score + _ratio(len(same_shape), g.count))
        parts.append(count_score)
    if scene.relation is not None:
        pairs = list(itertools.product(matched[0], matched[1]))
        ok = sum(relation_holds(a.centroid, b.centroid, scene.relation, resolution) for a, b in pairs)
        rel_score = ok / len(pairs) if pairs else 0.0
        exact &= bool(pairs) and ok == len(pairs)
        parts.append(rel_score)
    num_extra = sum(id(o) not in claimed for o in objects)
    expected = scene.num_objects
    partial = float(np.mean(parts)) * expected / (expected + num_extra)
    passed = exact and num_extra == 0
    assert passed == (partial == 1.0), "partial is 1.0 exactly when the scene passes"
    return SceneScore(passed=passed, partial=partial,
                      category=category_of(scene), num_extra=num_extra)


def score_image(image: np.ndarray, scene: Scene, **detect_kwargs) -> SceneScore:
    """Detect objects in a uint8 [H, W, 3] image and judge them against ``scene``."""
    objects = detect_objects(image, **detect_kwargs)
    return score_objects(objects, scene, min(image.shape[:2]))
