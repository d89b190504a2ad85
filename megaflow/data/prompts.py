"""Where a run's prompts come from: a pool (the ShapeEval grammar's training prompts, or the lines of a text
file) and the endless, seeded stream over it that the loop draws from."""
from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from pathlib import Path

SHAPES = "shapes"
SHAPES_POOL = 512  # training prompts drawn from the ShapeEval grammar


def prompt_pool(source: str, *, seed: int, categories: Sequence[str] = ()) -> list[str]:
    """The prompts of ``source`` (``data.prompts``): ``"shapes"`` = ShapeEval training prompts of ``categories``
    (all when empty) drawn with ``seed``, else a text file with one prompt per line; ValueError naming a
    missing or empty file."""
    if source == SHAPES:
        from megaflow.data.shapes import CATEGORIES, sample_prompts
        return sample_prompts("train", SHAPES_POOL, seed=seed, categories=tuple(categories) or CATEGORIES)
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"data.prompts: no such prompt file {path}")
    pool = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not pool:
        raise ValueError(f"data.prompts: {path} has no prompts")
    return pool


class PromptStream:
    """Endless, seeded prompt stream (reshuffled each pass) that counts what it handed out, so a resumed run
    continues at the same prompt: ``PromptStream(pool, seed, consumed=k)`` starts where one that handed
    out k prompts stopped."""

    def __init__(self, pool: list[str], seed: int, consumed: int = 0):
        self._pool, self._rng, self.consumed = pool, random.Random(seed), 0
        self._order: Iterator[str] = iter(())
        for _ in range(consumed):
            next(self)

    def __iter__(self):
        return self

    def __next__(self) -> str:
        try:
            prompt = next(self._order)
        except StopIteration:
            self._order = iter(self._rng.sample(self._pool, len(self._pool)))
            prompt = next(self._order)
        self.consumed += 1
        return prompt
