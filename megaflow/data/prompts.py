"""Where a run's prompts come from: a pool (the ShapeEval grammar's training prompts, the lines of a text
file, or the objects of a ``.jsonl`` file: a ``"prompt"`` plus fields handed to the rewards as metadata) and
the endless, seeded stream over it that the loop draws from."""
from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SHAPES = "shapes"
SHAPES_POOL = 512  # training prompts drawn from the ShapeEval grammar
MAX_PROMPT_CHARS = 2000  # a longer prompt is a mistake (text encoders read 77 to 512 tokens)


def json_object(text: str, where: str, want: str) -> dict:
    """``text`` parsed as one JSON object; ValueError ``"<where>: not JSON (...)"`` or ``"<where>: <want>, got
    <type>"`` (the one reading of a JSON-lines row, for prompt files and image manifests)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: {want}, got {type(obj).__name__}")
    return obj


@dataclass(frozen=True)
class PromptRecord:
    """A prompt with metadata for the rewards (a ``.jsonl`` line's fields other than ``"prompt"``)."""

    text: str
    metadata: dict = field(default_factory=dict)


def prompt_and_metadata(item: str | PromptRecord) -> tuple[str, dict]:
    """(prompt text, metadata) of a pool item: a plain string has no metadata."""
    if isinstance(item, PromptRecord):
        return item.text, dict(item.metadata)
    return item, {}


def read_jsonl_prompts(path: str | Path, key: str = "data.prompts") -> list[PromptRecord]:
    """The records of a ``.jsonl`` prompt file: one JSON object a line with a non-empty string ``"prompt"`` of
    at most ``MAX_PROMPT_CHARS`` characters (blank lines skipped); ValueError naming the config ``key``, the
    file and line of the first bad one."""
    path, records = Path(path), []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        obj = json_object(line, f"{key}: {path} line {n}", "expected a JSON object")
        prompt = obj.pop("prompt", None)
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{key}: {path} line {n}: needs a non-empty string 'prompt'")
        if len(prompt.strip()) > MAX_PROMPT_CHARS:
            raise ValueError(f"{key}: {path} line {n}: a prompt of {len(prompt.strip())} characters, longer "
                             f"than the {MAX_PROMPT_CHARS} a prompt may have")
        records.append(PromptRecord(prompt.strip(), obj))
    return records


def prompt_pool(source: str, *, seed: int, categories: Sequence[str] = (),
                key: str = "data.prompts") -> list[str] | list[PromptRecord]:
    """The prompts of ``source`` (``data.prompts``): ``"shapes"`` = ShapeEval training prompts of ``categories``
    (all when empty) drawn with ``seed``; a ``.jsonl`` file = its records (``read_jsonl_prompts``); else a text
    file with one prompt per line. ValueError naming the config ``key`` and a missing, empty or malformed file."""
    if source == SHAPES:
        from megaflow.data.shapes import CATEGORIES, sample_prompts
        return sample_prompts("train", SHAPES_POOL, seed=seed, categories=tuple(categories) or CATEGORIES)
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"{key}: no such prompt file {path}")
    if path.suffix == ".jsonl":
        pool = read_jsonl_prompts(path, key)
    else:
        pool = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not pool:
        raise ValueError(f"{key}: {path} has no prompts")
    return pool


class PromptStream:
    """Endless, seeded prompt stream (reshuffled each pass) that counts what it handed out, so a resumed run
    continues at the same prompt: ``PromptStream(pool, seed, consumed=k)`` starts where one that handed
    out k prompts stopped."""

    def __init__(self, pool: list[str] | list[PromptRecord], seed: int, consumed: int = 0):
        self._pool, self._rng, self.consumed = pool, random.Random(seed), 0
        self._order: Iterator[str | PromptRecord] = iter(())
        for _ in range(consumed):
            next(self)

    def __iter__(self):
        return self

    def __next__(self) -> str | PromptRecord:
        try:
            prompt = next(self._order)
        except StopIteration:
            self._order = iter(self._rng.sample(self._pool, len(self._pool)))
            prompt = next(self._order)
        self.consumed += 1
        return prompt
