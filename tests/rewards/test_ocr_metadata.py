"""Prompt metadata reaches the rewards, end to end at the scorer level: a ``.jsonl`` prompt file
(``data.prompts``) -> the run's prompt stream -> ``make_requests`` (``RolloutRequest.metadata``) -> a fake engine
that renders the text each request asks for -> ``sample_and_score`` -> the ``ocr`` reward, which scores the
renders against ``metadata["text"]`` where a line has one and against the prompt's quoted text elsewhere.

Needs: CPU, 1 process, 1 ONNX thread (~10 s: 8 OCR calls, and the run modules' imports)."""
from __future__ import annotations

import json
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import torch
from PIL import ImageFont

from megaflow.config import load_config
from megaflow.data.prompts import PromptRecord, PromptStream, prompt_pool
from megaflow.rewards.registry import build_multi_reward
from megaflow.rewards.scorer import AsyncScorer
from megaflow.rollout.hosted import sample_and_score
from megaflow.run.build import prompt_stream
from megaflow.run.requests import make_requests
from megaflow.testing.text_render import render_text as render

LINES = [{"prompt": 'A sign that says "OPEN"', "text": "TIGER", "style": "neon"},  # metadata overrides the quote
         {"prompt": 'A poster titled "MANGO"'}]


class RenderingEngine:
    """A perfect model: every sample of a request shows ``draw(request)``."""

    def __init__(self, draw):
        self.draw, self.seen = draw, []

    def submit(self, requests):
        futures = []
        for r in requests:
            self.seen.append(r)
            img = render(self.draw(r), ImageFont.load_default(size=40))
            image = torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255.0
            f = Future()
            f.set_result([SimpleNamespace(image=image, prompt=r.prompt, index=j) for j in range(r.num_outputs)])
            futures.append(f)
        return futures


def _cfg(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    return load_config(None, [f'data.prompts="{path}"', "rollout.prompts_per_iter=2", "rollout.group_size=2"])


def test_jsonl_pool_keeps_metadata(tmp_path):
    pool = prompt_pool(str(_cfg(tmp_path).data.prompts), seed=0)
    assert pool == [PromptRecord('A sign that says "OPEN"', {"text": "TIGER", "style": "neon"}),
                    PromptRecord('A poster titled "MANGO"', {})]
    assert sorted(r.text for r in [next(s) for s in [PromptStream(pool, 5)] for _ in range(2)]) == \
        sorted(line["prompt"] for line in LINES)


def test_metadata_reaches_the_ocr_reward(tmp_path):
    cfg = _cfg(tmp_path)
    requests = make_requests(cfg, prompt_stream(cfg), iteration=1)
    by_prompt = {r.prompt: r for r in requests}
    assert set(by_prompt) == {line["prompt"] for line in LINES}
    assert by_prompt['A sign that says "OPEN"'].metadata == {"text": "TIGER", "style": "neon"}
    assert by_prompt['A poster titled "MANGO"'].metadata == {}
    # The model draws what the metadata asks for, else the quoted text: every sample should score high.
    engine = RenderingEngine(lambda r: r.metadata.get("text") or r.prompt.split('"')[1])
    with AsyncScorer(build_multi_reward({"ocr": 1.0})) as scorer:
        trajs, scores, _ = sample_and_score(engine, scorer, requests)
        assert len(trajs) == 4 and (scores.components["ocr"] >= 0.9).all(), scores.components
        # Drawing the quoted text instead: the line with metadata now scores low, the other stays high.
        quoted = RenderingEngine(lambda r: r.prompt.split('"')[1])
        _, scores, _ = sample_and_score(quoted, scorer, requests)
    ocr = dict(zip([t.prompt for t in trajs], scores.components["ocr"].tolist()))
    assert ocr['A sign that says "OPEN"'] < 0.5 and ocr['A poster titled "MANGO"'] >= 0.9
