"""Video ShapeEval prompts: the image grammar's noun phrases (megaflow.data.shapes) with a motion or change
clause, from a closed grammar, so every prompt parses back into its :class:`VideoScene` and category; TRAIN and
held-out splits by the image split's rule (``shapes.hold_out``). Standard library only. Design notes:
docs/design/video_shapeeval.md.
"""
from __future__ import annotations

import dataclasses
import itertools
import random
import re

from megaflow.data.shapes import (GROUP_RE, PALETTE, RELATIONS, SHAPES, Group, Scene, group_from_match,
                                  hold_out, round_robin)

DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
"""Motion words -> unit (dx, dy) in pixels, y downwards."""
VIDEO_CATEGORIES: tuple[str, ...] = ("motion", "count_motion", "position_motion", "color_change")
VIDEO_MAX_COUNT = 3  # three moving objects at 32 px leave room to move
# Held-out share per category: a third of the small universes (motion 72 -> 24, color_change 90 -> 30), a quarter
# of the large ones (count_motion 144 -> 36, position_motion 2880 -> 720).
_HOLDOUT_FRACTION = {"motion": 1 / 3, "color_change": 1 / 3}
_DIRS = "|".join(DIRECTIONS)
_COLORS = "|".join(PALETTE)
_MOVE_RE = re.compile(rf"^{GROUP_RE} moving ({_DIRS})$")
_BOTH_RE = re.compile(rf"^{GROUP_RE} ({'|'.join(RELATIONS)}) {GROUP_RE},? both moving ({_DIRS})$")
_TURN_RE = re.compile(rf"^{GROUP_RE} turning ({_COLORS})$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VideoScene:
    """Groups (with an optional relation, as :class:`Scene`) and one clause: ``motion`` (a direction every object
    moves in, the whole clip) or ``change`` (the colour the one object turns into; ``groups[0].color`` is the
    colour it starts with)."""

    groups: tuple[Group, ...]
    relation: str | None = None
    motion: str | None = None
    change: str | None = None

    def __post_init__(self):
        if (self.motion is None) == (self.change is None):
            raise ValueError("a VideoScene has exactly one clause: motion or change")
        if self.motion is not None and self.motion not in DIRECTIONS:
            raise ValueError(f"unknown direction {self.motion!r} (known: {', '.join(DIRECTIONS)})")
        if self.change is not None and (len(self.groups) != 1 or self.groups[0].count != 1
                                        or self.groups[0].color in (None, self.change)):
            raise ValueError("a colour change is one coloured object turning into another palette colour")

    @property
    def scene(self) -> Scene:
        """The still scene every frame shows (a colour change: the object in any palette colour)."""
        if self.change is not None:
            return Scene(groups=(dataclasses.replace(self.groups[0], color=None),))
        return Scene(groups=self.groups, relation=self.relation)

    @property
    def prompt(self) -> str:
        first = self.groups[0].phrase()
        if self.change is not None:
            return f"{first} turning {self.change}"
        if self.relation is not None:
            return f"{first} {self.relation} {self.groups[1].phrase()}, both moving {self.motion}"
        return f"{first} moving {self.motion}"


def video_category_of(scene: VideoScene) -> str:
    if scene.change is not None:
        return "color_change"
    if len(scene.groups) == 2:
        return "position_motion"
    return "motion" if scene.groups[0].count == 1 else "count_motion"


def parse_video_prompt(prompt: str) -> VideoScene:
    """Parse a video ShapeEval prompt (case/space-insensitive, trailing period ignored) back into its VideoScene;
    ValueError naming the prompt when it is not in the grammar."""
    text = " ".join(prompt.strip().lower().rstrip(".").split())
    try:
        if m := _MOVE_RE.match(text):
            return VideoScene(groups=(group_from_match(*m.group(1, 2, 3, 4), prompt),), motion=m.group(5))
        if m := _BOTH_RE.match(text):
            a, b = group_from_match(*m.group(1, 2, 3, 4), prompt), group_from_match(*m.group(6, 7, 8, 9), prompt)
            if a.count != 1 or b.count != 1 or a.shape == b.shape and a.color == b.color:
                raise ValueError("'both moving' takes two different single objects")
            return VideoScene(groups=(a, b), relation=m.group(5), motion=m.group(10))
        if m := _TURN_RE.match(text):
            return VideoScene(groups=(group_from_match(*m.group(1, 2, 3, 4), prompt),), change=m.group(5))
    except ValueError as e:
        raise ValueError(f"not a video ShapeEval prompt: {prompt!r} ({e})") from None
    raise ValueError(f"not a video ShapeEval prompt: {prompt!r} (want e.g. 'a red circle moving left', "
                     "'a green triangle above a yellow circle, both moving right', 'a red square turning blue')")


def _video_universe(category: str) -> list[VideoScene]:
    """Every scene of a category, in a fixed order; every object has a colour."""
    kinds = [(s, c) for s in SHAPES for c in PALETTE]
    if category == "motion":
        return [VideoScene(groups=(Group(shape=s, color=c),), motion=d) for s, c in kinds for d in DIRECTIONS]
    if category == "count_motion":
        return [VideoScene(groups=(Group(shape=s, color=c, count=n),), motion=d)
                for s, c in kinds for n in range(2, VIDEO_MAX_COUNT + 1) for d in DIRECTIONS]
    if category == "position_motion":
        return [VideoScene(groups=(Group(shape=a, color=ca), Group(shape=b, color=cb)), relation=r, motion=d)
                for a, b in itertools.permutations(SHAPES, 2) for ca, cb in itertools.permutations(PALETTE, 2)
                for r in RELATIONS for d in DIRECTIONS]
    if category == "color_change":
        return [VideoScene(groups=(Group(shape=s, color=ca),), change=cb)
                for s in SHAPES for ca, cb in itertools.permutations(PALETTE, 2)]
    raise ValueError(f"unknown video ShapeEval category: {category!r} (known: {', '.join(VIDEO_CATEGORIES)})")


def _video_attributes(scene: VideoScene) -> set[tuple]:
    """Every (slot, attribute, value) a video scene uses: the words a held-out combination must still teach."""
    out = {("relation", scene.relation), ("motion", scene.motion), ("change", scene.change)}
    for i, g in enumerate(scene.groups):
        out |= {(i, "shape", g.shape), (i, "color", g.color), (i, "count", g.count)}
    return out


def split_video_prompts(*, seed: int = 0, eval_fraction: float = 0.25) -> dict[str, dict[str, tuple]]:
    """{"train": {category: scenes}, "eval": {...}}, disjoint per category: each universe shuffled with ``seed``,
    a third (small universes) or ``eval_fraction`` of it held out by ``shapes.hold_out`` (only while every word
    it uses -- shape, colour, count, relation, direction, target colour per slot -- is still in TRAIN)."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    train, held = {}, {}
    for i, cat in enumerate(VIDEO_CATEGORIES):
        scenes = _video_universe(cat)
        random.Random(seed * 1000 + 500 + i).shuffle(scenes)
        want = max(1, round(_HOLDOUT_FRACTION.get(cat, eval_fraction) * len(scenes)))
        chosen, rest = hold_out(scenes, want, _video_attributes)
        held[cat], train[cat] = tuple(chosen), tuple(rest)
    return {"train": train, "eval": held}


def sample_video_scenes(split: str, num: int, *, seed: int = 0, split_seed: int = 0,
                        categories: tuple[str, ...] = VIDEO_CATEGORIES) -> list[VideoScene]:
    """``num`` scenes of the ``"train"`` or ``"eval"`` split, round-robin over ``categories`` (as the image
    ``sample_scenes``); deterministic in its arguments."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    for cat in categories:
        if cat not in VIDEO_CATEGORIES:
            raise ValueError(f"unknown video ShapeEval category: {cat!r} (known: {', '.join(VIDEO_CATEGORIES)})")
    return round_robin(split_video_prompts(seed=split_seed)[split], categories, num, seed)


def sample_video_prompts(split: str, num: int, **kwargs) -> list[str]:
    """Prompt texts of :func:`sample_video_scenes` (same arguments)."""
    return [s.prompt for s in sample_video_scenes(split, num, **kwargs)]
