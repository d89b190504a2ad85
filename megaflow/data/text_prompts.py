"""A generated text-rendering prompt set (for ``ocr``) in flow_grpo's layout (``train.txt`` / ``test.txt``, plus
``.jsonl`` twins with the target text). Train and test words are disjoint. Standard library only.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "open", "closed", "sale", "exit", "stop", "hello", "coffee", "bakery", "books", "music", "garden", "pizza",
    "hotel", "taxi", "bank", "cinema", "market", "sushi", "river", "forest", "ocean", "summer", "winter",
    "spring", "autumn", "rocket", "planet", "galaxy", "dragon", "castle", "island", "harbor", "bridge", "tower",
    "museum", "library", "school", "office", "studio", "gallery", "theater", "station", "airport", "police",
    "doctor", "pharmacy", "flowers", "candy", "bread", "cheese", "tea", "juice", "lemon", "apple", "mango",
    "cherry", "peach", "melon", "honey", "sugar", "salt", "pepper", "garlic", "onion", "tomato", "carrot",
    "potato", "noodle", "burger", "donut", "cookie", "waffle", "pancake", "yogurt", "butter", "kitchen",
    "dinner", "lunch", "picnic", "camera", "guitar", "piano", "violin", "drums", "radio", "robot", "laptop",
    "phone", "window", "garage", "parking", "welcome", "thanks", "sorry", "danger", "caution", "quiet",
    "silence", "private", "public", "entry", "push", "pull", "free", "fresh", "daily", "weekly", "night",
    "morning", "sunset", "sunrise", "rainbow", "thunder", "storm", "cloud", "snow", "desert", "canyon",
    "valley", "meadow", "lagoon", "jungle", "tiger", "zebra", "panda", "koala", "otter", "falcon", "eagle",
    "parrot", "dolphin", "whale", "shark", "turtle", "rabbit", "kitten", "puppy", "pony", "unicorn", "wizard",
    "pirate", "knight", "queen", "king", "prince", "jazz", "disco", "dance", "party", "happy", "lucky",
    "magic", "dream", "smile", "peace", "love", "hope", "brave", "vintage", "retro", "modern", "classic",
)

TEMPLATES = (
    'A shop sign that says "{}"',
    'A neon sign reading "{}"',
    'A wooden board with the word "{}" painted on it',
    'A poster with the title "{}"',
    'A coffee mug printed with "{}"',
    'A street sign that reads "{}"',
    'A chalkboard with "{}" written on it',
    'A T-shirt with the text "{}"',
    'A book cover titled "{}"',
    'A cake with "{}" written in icing',
    'A license plate that says "{}"',
    'A banner with the word "{}"',
)

CASES = (str.upper, str.capitalize, str.lower)


def split_words(seed: int, test_fraction: float = 0.2) -> tuple[list[str], list[str]]:
    """(train words, test words): ``WORDS`` shuffled with ``seed`` and cut; disjoint, both non-empty."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    words = sorted(set(WORDS))
    random.Random(seed).shuffle(words)
    num_test = min(len(words) - 1, max(1, round(len(words) * test_fraction)))
    return words[num_test:], words[:num_test]


def make_prompts(words: list[str], per_word: int, seed: int) -> list[tuple[str, str]]:
    """(prompt, text) pairs: each word in ``per_word`` distinct templates, each time in a random letter case;
    the pairs are shuffled with ``seed``."""
    if not 1 <= per_word <= len(TEMPLATES):
        raise ValueError(f"per_word must be in [1, {len(TEMPLATES)}], got {per_word}")
    rng = random.Random(seed)
    pairs = []
    for word in words:
        for template in rng.sample(TEMPLATES, per_word):
            text = rng.choice(CASES)(word)
            pairs.append((template.format(text), text))
    rng.shuffle(pairs)
    return pairs


def quoted_text(prompt: str) -> str:
    """The text between the first pair of double quotes of ``prompt``; ValueError when there is none."""
    parts = prompt.split('"')
    if len(parts) < 3:
        raise ValueError(f"no double-quoted text in prompt {prompt!r}")
    return parts[1]


def write_prompt_set(out: str | Path, *, seed: int = 0, train_per_word: int = 6, test_per_word: int = 2,
                     test_fraction: float = 0.2) -> dict[str, int]:
    """Write ``train.txt``, ``test.txt``, ``train.jsonl`` and ``test.jsonl`` into ``out`` (created); returns the
    number of prompts per split. Test prompts use their own seed stream, so the two splits are independent."""
    train_words, test_words = split_words(seed, test_fraction)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, words, per_word, offset in (("train", train_words, train_per_word, 1),
                                           ("test", test_words, test_per_word, 2)):
        pairs = make_prompts(words, per_word, seed * 1_000_003 + offset)
        (out / f"{split}.txt").write_text("".join(f"{p}\n" for p, _ in pairs))
        (out / f"{split}.jsonl").write_text("".join(json.dumps({"prompt": p, "text": t}) + "\n" for p, t in pairs))
        counts[split] = len(pairs)
    return counts
