"""The text-rendering prompt set: disjoint train/test words, every prompt parses back to its text, the
files are flow_grpo's layout (+ jsonl twins), the tool writes them and refuses to overwrite.

Needs: CPU, 1 process, no torch (< 2 s)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megaflow.data.text_prompts import WORDS, make_prompts, quoted_text, split_words, write_prompt_set

TOOL = Path(__file__).resolve().parents[2] / "tools" / "make_text_prompts.py"


def test_split_is_disjoint_seeded_and_covers_the_words():
    train, test = split_words(seed=3)
    assert not {w.lower() for w in train} & {w.lower() for w in test}
    assert sorted(train + test) == sorted(set(WORDS))
    assert len(test) == round(len(set(WORDS)) * 0.2)
    assert split_words(seed=3) == (train, test)
    assert split_words(seed=4) != (train, test)


def test_every_prompt_parses_back_to_its_word():
    pairs = make_prompts(["open", "tiger"], per_word=5, seed=0)
    assert len(pairs) == 10 and len({p for p, _ in pairs}) == 10
    for prompt, text in pairs:
        assert quoted_text(prompt) == text and text.lower() in ("open", "tiger")
    with pytest.raises(ValueError, match="no double-quoted text"):
        quoted_text("a sign")


def test_written_set_is_flow_grpo_layout_with_disjoint_splits(tmp_path):
    counts = write_prompt_set(tmp_path, seed=1, train_per_word=3, test_per_word=2)
    train_words, test_words = split_words(seed=1)
    lines = {s: (tmp_path / f"{s}.txt").read_text().splitlines() for s in ("train", "test")}
    assert counts == {"train": 3 * len(train_words), "test": 2 * len(test_words)}
    assert {s: len(v) for s, v in lines.items()} == counts
    parsed = {s: {quoted_text(p).lower() for p in v} for s, v in lines.items()}
    assert parsed == {"train": set(train_words), "test": set(test_words)}
    for split in ("train", "test"):
        rows = [json.loads(x) for x in (tmp_path / f"{split}.jsonl").read_text().splitlines()]
        assert [r["prompt"] for r in rows] == lines[split]
        assert all(quoted_text(r["prompt"]) == r["text"] for r in rows)


def test_tool_writes_the_set_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "set"
    run = [sys.executable, str(TOOL), "--out", str(out), "--seed", "2"]
    first = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    assert (out / "train.txt").read_text() == _expected(tmp_path / "ref", seed=2)
    again = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "exists" in again.stderr and again.stderr.count("\n") == 1


def _expected(path: Path, seed: int) -> str:
    write_prompt_set(path, seed=seed)
    return (path / "train.txt").read_text()


def test_shipped_set_is_the_tools_output_at_seed_0(tmp_path):
    """assets/text_prompts (configs/sd3_medium_ocr_8xh100.toml trains on it) is what the generator writes."""
    shipped = Path(__file__).resolve().parents[2] / "assets" / "text_prompts"
    write_prompt_set(tmp_path, seed=0)
    for name in ("train.txt", "test.txt", "train.jsonl", "test.jsonl"):
        assert (shipped / name).read_text() == (tmp_path / name).read_text(), name
