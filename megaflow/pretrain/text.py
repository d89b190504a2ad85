"""Text encoders that understand ShapeEval prompts: a family's encoders (whole-word tokenizers) trained on the
grammar's scene-parsing objective, then frozen; the family's kit says where each word sits and which states the
pipeline reads. A video prompt's labels add its clause (the direction every object moves in, or the colour the
object turns into) as one more pooled head. Design notes: docs/design/pretrain.md.
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from megaflow.data.shapes import MAX_COUNT, PALETTE, RELATIONS, SHAPES, Scene, parse_prompt
from megaflow.data.video_shapes import DIRECTIONS, VideoScene

COLORS = (None, *PALETTE)
RELATION_CLASSES = ("none", "and", *RELATIONS)
CLAUSE_CLASSES = (*(f"moving {d}" for d in DIRECTIONS), *(f"turning {c}" for c in PALETTE))


def _group_labels(g) -> list[int]:
    return [SHAPES.index(g.shape), COLORS.index(g.color), g.count - 1]


def scene_labels(scene: Scene | VideoScene) -> dict[str, list[int]]:
    """Class labels of a scene: per noun token (group shape/colour/count/index/relation) and pooled (a video
    scene's pooled labels end with its clause, ``CLAUSE_CLASSES``)."""
    rel = RELATION_CLASSES.index(scene.relation or ("and" if len(scene.groups) == 2 else "none"))
    nouns = [_group_labels(g) + [i, rel if i == 1 else 0] for i, g in enumerate(scene.groups)]
    g1 = _group_labels(scene.groups[1]) if len(scene.groups) == 2 else [len(SHAPES), len(COLORS), MAX_COUNT]
    pooled = _group_labels(scene.groups[0]) + g1 + [rel]
    if isinstance(scene, VideoScene):
        pooled.append(CLAUSE_CLASSES.index(f"moving {scene.motion}" if scene.motion else f"turning {scene.change}"))
    return {"nouns": nouns, "pooled": pooled}


# (head name, classes) of the per-noun and the pooled predictions, in label order.
NOUN_HEADS = (("shape", len(SHAPES)), ("color", len(COLORS)), ("count", MAX_COUNT), ("group", 2),
              ("relation", len(RELATION_CLASSES)))
POOLED_HEADS = (("shape0", len(SHAPES)), ("color0", len(COLORS)), ("count0", MAX_COUNT),
                ("shape1", len(SHAPES) + 1), ("color1", len(COLORS) + 1), ("count1", MAX_COUNT + 1),
                ("relation", len(RELATION_CLASSES)))
CLAUSE_HEAD = ("clause", len(CLAUSE_CLASSES))


def noun_positions(kit, tokenizer, prompt: str) -> list[int]:
    """Token indices of the group nouns of ``prompt`` (the family's ``word_positions``)."""
    nouns = {*SHAPES, *(s + "s" for s in SHAPES)}
    positions = kit.word_positions(tokenizer, prompt)
    return [positions[i] for i, w in enumerate(prompt.split()) if w.rstrip(",") in nouns]


def _forward(kit, encoder, tokenizer, heads, prompts: list[str], labels: list[dict], positions: list[list[int]]):
    """(loss, per-noun all-heads-correct [M], per-prompt pooled all-heads-correct [N])."""
    noun_heads, pooled_heads = heads
    per_token, pooled = kit.text_features(encoder, tokenizer, prompts)
    rows, cols, noun_y = [], [], []
    for r, (pos, lab) in enumerate(zip(positions, labels)):
        for p, y in zip(pos, lab["nouns"]):
            rows.append(r), cols.append(p), noun_y.append(y)
    noun_h = per_token[torch.tensor(rows), torch.tensor(cols)]
    noun_y = torch.tensor(noun_y)
    pooled_y = torch.tensor([lab["pooled"] for lab in labels])
    noun_logits = [h(noun_h) for h in noun_heads]
    pooled_logits = [h(pooled) for h in pooled_heads]
    loss = sum(F.cross_entropy(lg, noun_y[:, k]) for k, lg in enumerate(noun_logits))
    loss = loss + sum(F.cross_entropy(lg, pooled_y[:, k]) for k, lg in enumerate(pooled_logits))
    noun_ok = torch.stack([lg.argmax(-1) == noun_y[:, k] for k, lg in enumerate(noun_logits)]).all(0)
    pooled_ok = torch.stack([lg.argmax(-1) == pooled_y[:, k] for k, lg in enumerate(pooled_logits)]).all(0)
    return loss, noun_ok, pooled_ok


def train_text_encoder(kit, encoder, tokenizer, prompts: list[str], *, steps: int = 400, batch: int = 128,
                       lr: float = 3e-3, seed: int = 0, eval_prompts: list[str] | None = None,
                       parse=parse_prompt) -> dict:
    """Train ``encoder`` in place on the scene-parsing objective (AdamW, seeded minibatches of ``prompts``, parsed by
    ``parse``: the image grammar's, or the video grammar's for clause labels too; the states read as the family's
    ``kit.text_features`` says); returns the final loss and parse accuracies (every head right) on ``prompts`` and,
    if given, on ``eval_prompts`` (``eval_noun_acc``, ``eval_pooled_acc``)."""
    with torch.no_grad():
        per_token, pooled = kit.text_features(encoder, tokenizer, prompts[:1])
    hidden, proj = per_token.shape[-1], pooled.shape[-1]
    labels = [scene_labels(parse(p)) for p in prompts]
    pooled_heads = POOLED_HEADS + (CLAUSE_HEAD,) * (len(labels[0]["pooled"]) - len(POOLED_HEADS))
    torch.manual_seed(seed)
    heads = (torch.nn.ModuleList(torch.nn.Linear(hidden, n) for _, n in NOUN_HEADS),
             torch.nn.ModuleList(torch.nn.Linear(proj, n) for _, n in pooled_heads))
    params = list(encoder.parameters()) + list(heads[0].parameters()) + list(heads[1].parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    positions = [noun_positions(kit, tokenizer, p) for p in prompts]
    rng = random.Random(seed)
    encoder.train()
    for _ in range(steps):
        idx = rng.sample(range(len(prompts)), min(batch, len(prompts)))
        loss, _, _ = _forward(kit, encoder, tokenizer, heads, [prompts[i] for i in idx], [labels[i] for i in idx],
                              [positions[i] for i in idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    encoder.eval()
    with torch.no_grad():
        loss, noun_ok, pooled_ok = _forward(kit, encoder, tokenizer, heads, prompts, labels, positions)
        stats = {"loss": float(loss), "noun_acc": float(noun_ok.float().mean()),
                 "pooled_acc": float(pooled_ok.float().mean())}
        if eval_prompts:
            ev_labels = [scene_labels(parse(p)) for p in eval_prompts]
            ev_pos = [noun_positions(kit, tokenizer, p) for p in eval_prompts]
            _, noun_ok, pooled_ok = _forward(kit, encoder, tokenizer, heads, eval_prompts, ev_labels, ev_pos)
            stats.update(eval_noun_acc=float(noun_ok.float().mean()), eval_pooled_acc=float(pooled_ok.float().mean()))
    return stats
