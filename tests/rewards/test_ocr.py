"""The ``ocr`` reward on real renders: words drawn with Pillow (its built-in font and the DejaVu fonts when the
system has them) at several sizes and colours on plain backgrounds are read back by RapidOCR (the PP-OCRv4
models in the rapidocr-onnxruntime wheel, offline) and score >= 0.9; a misspelt render scores
1 - d/len(target) within one character (1/len(target)) of OCR slack; a blank image scores 0; metadata["text"]
overrides the prompt's quoted text; a prompt without quoted text is masked. Plus the exact string parts
(normalisation, edit distance, score).

Needs: CPU, 1 process, 1 ONNX thread (~10-20 s: 12 OCR calls on 256 x 256 images)."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from PIL import ImageFont

from megaflow.rewards.base import safe_score
from megaflow.rewards.ocr import OcrReward, levenshtein, normalise, target_text, text_score
from megaflow.rewards.registry import build_reward
from megaflow.testing.text_render import render_text as render, text_fonts

SIDE = 256


@pytest.fixture(scope="module")
def reward():
    return OcrReward()


# (font, size, word, foreground, background): three sizes, dark on light and light on dark.
CASES = [("pillow-default", 24, "OPEN", (0, 0, 0), (255, 255, 255)),
         ("pillow-default", 40, "Coffee", (20, 40, 160), (250, 240, 200)),
         ("pillow-default", 56, "TIGER", (255, 255, 255), (30, 30, 30)),
         ("DejaVuSans.ttf", 24, "welcome", (0, 0, 0), (230, 230, 230)),
         ("DejaVuSans.ttf", 48, "Garden", (200, 30, 30), (255, 255, 255)),
         ("DejaVuSerif-Bold.ttf", 36, "BAKERY", (250, 250, 120), (20, 60, 20))]


def test_rendered_words_are_read_back(reward, capsys):
    available = text_fonts()
    cases = [c for c in CASES if c[0] in available]
    assert len({c[0] for c in cases}) >= 2, f"need two fonts, have {sorted(available)}"
    images = [render(word, available[font](size), fg=fg, bg=bg) for font, size, word, fg, bg in cases]
    prompts = [f'A sign that says "{word}"' for _, _, word, _, _ in cases]
    reward(images[:1], prompts[:1])  # build the engine outside the timing
    t0 = time.perf_counter()
    scores = reward(images, prompts)
    per_image = (time.perf_counter() - t0) / len(images)
    with capsys.disabled():
        print(f"\nocr: {per_image:.3f} s/image; " + ", ".join(f"{c[0]}@{c[1]} {c[2]}={s:.2f}"
                                                            for c, s in zip(cases, scores.tolist())))
    assert scores.dtype == torch.float32 and scores.shape == (len(cases),)
    assert (scores >= 0.9).all(), dict(zip([c[2] for c in cases], scores.tolist()))


@pytest.mark.parametrize("drawn, target", [("COFEE", "COFFEE"), ("GARDNE", "GARDEN"), ("WEL COME", "WELCOME")])
def test_misspelt_render_scores_in_proportion(reward, drawn, target):
    """1 - d/len(target) with d the edit distance of the drawn text to the target (spaces do not count), give or
    take one character misread: |score - expected| <= 1/len(target)."""
    expected = max(0.0, 1.0 - levenshtein(normalise(drawn), normalise(target)) / len(target))
    score = float(reward([render(drawn, ImageFont.load_default(size=40))], [f'A sign that says "{target}"'])[0])
    assert abs(score - expected) <= 1.0 / len(target) + 1e-6, (drawn, target, score, expected)
    assert score < 1.0 or expected == 1.0


def test_blank_images_score_zero(reward):
    blank = np.stack([np.full((SIDE, SIDE, 3), v, dtype=np.uint8) for v in (255, 0, 128)])
    assert reward(blank, ['A sign that says "OPEN"'] * 3).tolist() == [0.0, 0.0, 0.0]


def test_metadata_text_overrides_the_prompt(reward):
    img = render("TIGER", ImageFont.load_default(size=48))
    as_tensor = torch.from_numpy(np.array(img)).permute(2, 0, 1)[None].float() / 255.0  # the rollout's form
    prompt = 'A sign that says "OPEN"'
    assert float(reward(as_tensor, [prompt], [{"text": "tiger"}])[0]) >= 0.9
    assert float(reward(as_tensor, [prompt], [{}])[0]) < 0.5
    assert float(build_reward("ocr", key="word")(as_tensor, [prompt], [{"word": "Tiger"}])[0]) >= 0.9


def test_prompt_without_quoted_text_is_masked(reward):
    images = np.full((2, SIDE, SIDE, 3), 255, dtype=np.uint8)
    scores = safe_score(reward, images, ["a sign", 'a sign that says "OPEN"'])
    assert torch.isnan(scores[0]) and scores[1] == 0.0
    with pytest.raises(ValueError, match="no double-quoted text"):
        target_text("a sign", {})
    with pytest.raises(ValueError, match="empty target"):
        target_text('a sign that says " "', None)
    with pytest.raises(ValueError, match=r"metadata\['text'\] must be a string"):
        target_text('"x"', {"text": 3})


def test_string_parts():
    assert normalise(" Hello  World\n") == "helloworld"
    assert [levenshtein(a, b) for a, b in [("", ""), ("abc", ""), ("kitten", "sitting"), ("flaw", "lawn")]] == [0, 3, 3, 2]
    assert text_score("OPEN", "open") == 1.0 and text_score("", "open") == 0.0
    assert text_score("opne", "open") == pytest.approx(0.5) and text_score("openopenopen", "open") == 0.0
    assert target_text('A "first" and "second"', None) == "first"


def test_bad_kwargs_fail_at_build():
    with pytest.raises(ValueError, match="threads"):
        build_reward("ocr", threads=0)
    with pytest.raises(ValueError, match="bad arguments"):
        build_reward("ocr", colour="red")
