"""ShapeEval prompts: a GenEval-like compositional benchmark for tiny images, from a closed grammar, so every
prompt parses back into its :class:`Scene` and category. Design notes: docs/design/data.md.
"""
from __future__ import annotations

import dataclasses
import itertools
import random
import re

# Well-separated palette (min pairwise RGB distance > 120, all far from the white background).
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (240, 210, 20),
    "purple": (150, 50, 190),
    "cyan": (20, 200, 210),
}
BACKGROUND: tuple[int, int, int] = (255, 255, 255)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
CATEGORIES: tuple[str, ...] = (
    "single_object", "colors", "counting", "two_object", "color_attr", "position", "composite")
MAX_COUNT = 4
_COUNT_WORDS = {1: "a", 2: "two", 3: "three", 4: "four"}
_WORD_COUNTS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Group:
    """``count`` objects of one ``shape``; ``color`` None means any palette colour is fine."""

    shape: str
    count: int = 1
    color: str | None = None

    def phrase(self) -> str:
        noun = self.shape + ("s" if self.count > 1 else "")
        words = [_COUNT_WORDS[self.count]] + ([self.color] if self.color else []) + [noun]
        return " ".join(words)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scene:
    """One or two groups; with two groups an optional ``relation`` says where groups[0] is
    relative to groups[1] (every object of the first group, against every object of the second)."""

    groups: tuple[Group, ...]
    relation: str | None = None

    @property
    def prompt(self) -> str:
        if len(self.groups) == 1:
            return self.groups[0].phrase()
        joiner = self.relation if self.relation else "and"
        return f"{self.groups[0].phrase()} {joiner} {self.groups[1].phrase()}"

    @property
    def num_objects(self) -> int:
        return sum(g.count for g in self.groups)


def category_of(scene: Scene) -> str:
    """The GenEval-like category implied by a scene's structure (see module table)."""
    gs = scene.groups
    if len(gs) == 1:
        g = gs[0]
        if g.count == 1:
            return "colors" if g.color else "single_object"
        return "counting" if g.color is None else "composite"
    counts_one = all(g.count == 1 for g in gs)
    colored = all(g.color for g in gs)
    uncolored = all(g.color is None for g in gs)
    if counts_one and scene.relation is None and uncolored:
        return "two_object"
    if counts_one and scene.relation is None and colored:
        return "color_attr"
    if counts_one and scene.relation is not None and uncolored:
        return "position"
    return "composite"


GROUP_RE = (r"(a|an|one|two|three|four) (?:(" + "|".join(PALETTE) + r") )?("
             + "|".join(SHAPES) + r")(s?)")
_PROMPT_RE = re.compile(
    rf"^{GROUP_RE}(?: (and|{'|'.join(RELATIONS)}) {GROUP_RE})?$")


def group_from_match(count_word: str, color: str | None, shape: str, plural: str, prompt: str) -> Group:
    count = _WORD_COUNTS[count_word]
    if (count > 1) != bool(plural):
        raise ValueError(f"ShapeEval prompt has count/plural mismatch: {prompt!r}")
    return Group(shape=shape, count=count, color=color)


def parse_prompt(prompt: str) -> Scene:
    """Parse a ShapeEval prompt (case/space-insensitive) back into its Scene; ValueError if the
    text is not in the grammar or describes an ambiguous scene (two groups that could match the
    same object)."""
    text = " ".join(prompt.strip().lower().rstrip(".").split())
    m = _PROMPT_RE.match(text)
    if m is None:
        raise ValueError(f"not a ShapeEval prompt: {prompt!r}")
    groups = [group_from_match(*m.group(1, 2, 3, 4), prompt)]
    relation = None
    if m.group(5):
        groups.append(group_from_match(*m.group(6, 7, 8, 9), prompt))
        relation = None if m.group(5) == "and" else m.group(5)
    scene = Scene(groups=tuple(groups), relation=relation)
    if len(groups) == 2 and not _groups_disjoint(groups[0], groups[1]):
        raise ValueError(f"ShapeEval prompt has groups that overlap (same shape, a colour missing): {prompt!r}")
    return scene


def _groups_disjoint(a: Group, b: Group) -> bool:
    """True when no single object can match both groups."""
    if a.shape != b.shape:
        return True
    return a.color is not None and b.color is not None and a.color != b.color


def relation_margin(resolution: int) -> float:
    """Minimum centroid offset (pixels) along a relation's axis: 10% of the image side."""
    return 0.1 * resolution


def relation_holds(a: tuple[float, float], b: tuple[float, float], relation: str, resolution: int,
                   slack: float = 0.0) -> bool:
    """Whether centroid ``a`` (x, y; y grows downwards) is ``relation`` of centroid ``b``: the
    offset along the relation's axis is at least ``relation_margin`` and dominates the other axis.
    Shared by the renderer (which asks for ``slack`` extra pixels, so anti-aliasing cannot flip a
    borderline case) and the checker (slack 0)."""
    dx, dy = b[0] - a[0], b[1] - a[1]
    along, across = {"left of": (dx, dy), "right of": (-dx, dy), "above": (dy, dx), "below": (-dy, dx)}[relation]
    return along >= relation_margin(resolution) + slack and abs(across) + slack <= along


def _universe(category: str) -> list[Scene]:
    """Every scene of a category, in a fixed order."""
    colors, shapes = list(PALETTE), list(SHAPES)
    shape_pairs = [(a, b) for a, b in itertools.permutations(shapes, 2)]
    if category == "single_object":
        return [Scene(groups=(Group(shape=s),)) for s in shapes]
    if category == "colors":
        return [Scene(groups=(Group(shape=s, color=c),)) for s in shapes for c in colors]
    if category == "counting":
        return [Scene(groups=(Group(shape=s, count=n),)) for s in shapes for n in range(2, MAX_COUNT + 1)]
    if category == "two_object":
        return [Scene(groups=(Group(shape=a), Group(shape=b))) for a, b in shape_pairs]
    if category == "color_attr":
        return [Scene(groups=(Group(shape=a, color=ca), Group(shape=b, color=cb)))
                for a, b in shape_pairs for ca, cb in itertools.permutations(colors, 2)]
    if category == "position":
        return [Scene(groups=(Group(shape=a), Group(shape=b)), relation=r)
                for a, b in shape_pairs for r in RELATIONS]
    if category == "composite":
        kinds = [(s, c) for s in shapes for c in colors]
        counts = [(n0, n1) for n0 in range(1, MAX_COUNT) for n1 in range(1, MAX_COUNT)
                  if n0 + n1 <= MAX_COUNT and max(n0, n1) > 1]
        return [Scene(groups=(Group(shape=k0[0], color=k0[1], count=n0),
                              Group(shape=k1[0], color=k1[1], count=n1)), relation=r)
                for k0, k1 in itertools.permutations(kinds, 2) for n0, n1 in counts for r in RELATIONS]
    raise ValueError(f"unknown ShapeEval category: {category!r} (known: {', '.join(CATEGORIES)})")


# Categories whose universe is too small to hold anything out (3 and 6 prompts): every prompt is
# trained on, and evaluation reports them apart, as seen during training.
SEEN_CATEGORIES: tuple[str, ...] = ("single_object", "two_object")
HELD_OUT_CATEGORIES: tuple[str, ...] = tuple(c for c in CATEGORIES if c not in SEEN_CATEGORIES)
# Held-out share per category: a third of the small universes (colors 18 -> 6, counting 9 -> 3,
# position 24 -> 8), a quarter of the large ones (color_attr 180 -> 45, composite 6120 -> 1530).
_HOLDOUT_FRACTION = {"colors": 1 / 3, "counting": 1 / 3, "position": 1 / 3}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptSplit:
    """Train / eval scenes per category. For ``HELD_OUT_CATEGORIES`` the two are disjoint; for
    ``SEEN_CATEGORIES`` both hold the whole universe (reported apart as seen during training)."""

    train: dict[str, tuple[Scene, ...]]
    eval: dict[str, tuple[Scene, ...]]


def _attributes(scene: Scene) -> set[tuple]:
    """Every (slot, attribute, value) a scene uses: the words a held-out combination must still teach."""
    out = {("relation", scene.relation)}
    for i, g in enumerate(scene.groups):
        out |= {(i, "shape", g.shape), (i, "color", g.color), (i, "count", g.count)}
    return out


def hold_out(scenes: list, want: int, attributes) -> tuple[list, list]:
    """(held out, train) of ``scenes`` (already shuffled): walk them in order, holding a scene out (until ``want``
    are) only while every attribute it uses (``attributes(scene)``, a set) still occurs in a scene left to train
    on. The fixed rule of every ShapeEval split, image and video: a held-out prompt is a new combination of seen
    words."""
    counts: dict[tuple, int] = {}
    for s in scenes:
        for a in attributes(s):
            counts[a] = counts.get(a, 0) + 1
    chosen = []
    for s in scenes:
        if len(chosen) == want:
            break
        attrs = attributes(s)
        if all(counts[a] > 1 for a in attrs):
            chosen.append(s)
            for a in attrs:
                counts[a] -= 1
    picked = set(chosen)
    return chosen, [s for s in scenes if s not in picked]


def split_prompts(*, seed: int = 0, eval_fraction: float = 0.25) -> PromptSplit:
    """Hold out combinations, not words: each held-out category's universe is shuffled with ``seed``
    and scenes are held out (``eval_fraction``, or a third of the small universes) only while every
    attribute they use -- shape, colour, count per group, relation -- still occurs in that category's
    training scenes (``hold_out``). So a held-out prompt is a new combination of seen words."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    train, held = {}, {}
    for i, cat in enumerate(CATEGORIES):
        scenes = _universe(cat)
        if cat in SEEN_CATEGORIES:
            train[cat] = held[cat] = tuple(scenes)
            continue
        random.Random(seed * 1000 + i).shuffle(scenes)
        want = max(1, round(_HOLDOUT_FRACTION.get(cat, eval_fraction) * len(scenes)))
        chosen, rest = hold_out(scenes, want, _attributes)
        held[cat], train[cat] = tuple(chosen), tuple(rest)
    return PromptSplit(train=train, eval=held)


def round_robin(pools: dict, categories: tuple[str, ...], num: int, seed: int) -> list:
    """``num`` items balanced round-robin over ``categories``, each cycling through its own ``seed``-shuffled
    pool (repeats only once a category is exhausted); shared by the image and video samplers."""
    rng = random.Random(seed)
    orders = {c: rng.sample(pools[c], len(pools[c])) for c in categories}
    out = []
    for i in range(num):
        cat = categories[i % len(categories)]
        k = i // len(categories)
        out.append(orders[cat][k % len(orders[cat])])
    return out


def sample_scenes(split: str, num: int, *, seed: int = 0, split_seed: int = 0,
                  categories: tuple[str, ...] = CATEGORIES) -> list[Scene]:
    """``num`` scenes from the ``"train"`` or ``"eval"`` split, balanced round-robin over
    ``categories``; each category cycles through its own seeded shuffle (repeats only once a
    category is exhausted). Deterministic in (split, num, seed, split_seed, categories)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    for cat in categories:
        if cat not in CATEGORIES:
            raise ValueError(f"unknown ShapeEval category: {cat!r} (known: {', '.join(CATEGORIES)})")
    return round_robin(getattr(split_prompts(seed=split_seed), split), categories, num, seed)


def sample_prompts(split: str, num: int, **kwargs) -> list[str]:
    """Prompt texts of :func:`sample_scenes` (same arguments)."""
    return [s.prompt for s in sample_scenes(split, num, **kwargs)]


def shapes_vocabulary() -> tuple[str, ...]:
    """Every word of the ShapeEval grammar (one token each in the ShapeEval pipelines' tokenizers)."""
    words = ["a", "an", "one", "two", "three", "four", "and", *PALETTE, *SHAPES, *(s + "s" for s in SHAPES)]
    for rel in RELATIONS:
        words += rel.split()
    return tuple(dict.fromkeys(words))
