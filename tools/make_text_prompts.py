"""Write megaflow's procedurally generated text-rendering prompt set (the ``ocr`` reward's prompts).

    python tools/make_text_prompts.py --out data/text_prompts [--seed 0] [--train-per-word 6] [--test-per-word 2]

Writes ``train.txt`` / ``test.txt`` (flow_grpo's layout: one prompt a line, the text in double quotes) and
``train.jsonl`` / ``test.jsonl`` (the same prompts with a ``text`` field) into ``--out``; train and test words
are disjoint (``megaflow.data.text_prompts``). Refuses to overwrite an existing ``train.txt`` (exit code 2).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megaflow.data.text_prompts import write_prompt_set


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument("--seed", type=int, default=0, help="word split and prompt seed")
    parser.add_argument("--train-per-word", type=int, default=6, help="templates per train word")
    parser.add_argument("--test-per-word", type=int, default=2, help="templates per test word")
    parser.add_argument("--test-fraction", type=float, default=0.2, help="share of the words held out")
    args = parser.parse_args(argv)
    if (Path(args.out) / "train.txt").exists():
        print(f"make_text_prompts: {Path(args.out) / 'train.txt'} exists; not overwriting", file=sys.stderr)
        return 2
    try:
        counts = write_prompt_set(args.out, seed=args.seed, train_per_word=args.train_per_word,
                                  test_per_word=args.test_per_word, test_fraction=args.test_fraction)
    except ValueError as e:
        print(f"make_text_prompts: {e}", file=sys.stderr)
        return 2
    print(f"wrote {counts['train']} train and {counts['test']} test prompts to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
