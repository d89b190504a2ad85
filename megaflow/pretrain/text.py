"""Text encoders that understand ShapeEval prompts: whole-word tokenizers and two CLIP stand-ins pretrained on
the grammar, then frozen. Design notes: docs/design/pretrain.md.
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from megaflow.data.shapes import MAX_COUNT, PALETTE, RELATIONS, SHAPES, Scene, parse_prompt

COLORS = (None, *PALETTE)
RELATION_CLASSES = ("none", "and", *RELATIONS)


def shapes_vocabulary() -> tuple[str, ...]:
    """Every word of the ShapeEval grammar (one token each in the pipeline's tokenizers)."""
    words = ["a", "an", "one", "two", "three", "four", "and", *PALETTE, *SHAPES, *(s + "s" for s in SHAPES)]
    for rel in RELATIONS:
        words += rel.split()
    return tuple(dict.fromkeys(words))


def _group_labels(g) -> list[int]:
    return [SHAPES.index(g.shape), COLORS.index(g.color), g.count - 1]


def scene_labels(scene: Scene) -> dict[str, list[int]]:
    """Class labels of a scene: per noun token (group shape/colour/count/index/relation) and pooled."""
    rel = RELATION_CLASSES.index(scene.relation or ("and" if len(scene.groups) == 2 else "none"))
    nouns = [_group_labels(g) + [i, rel if i == 1 else 0] for i, g in enumerate(scene.groups)]
    g1 = _group_labels(scene.groups[1]) if len(scene.groups) == 2 else [len(SHAPES), len(COLORS), MAX_COUNT]
    return {"nouns": nouns, "pooled": _group_labels(scene.groups[0]) + g1 + [rel]}


# (head name, classes) of the per-noun and the pooled predictions, in label order.
NOUN_HEADS = (("shape", len(SHAPES)), ("color", len(COLORS)), ("count", MAX_COUNT), ("group", 2),
              ("relation", len(RELATION_CLASSES)))
POOLED_HEADS = (("shape0", len(SHAPES)), ("color0", len(COLORS)), ("count0", MAX_COUNT),
                ("shape1", len(SHAPES) + 1), ("color1", len(COLORS) + 1), ("count1", MAX_COUNT + 1),
                ("relation", len(RELATION_CLASSES)))


def noun_positions(tokenizer, prompt: str) -> list[int]:
    """Token indices of the group nouns (each word is one token after the start token)."""
    words = prompt.split()
    ids = tokenizer(prompt)["input_ids"]
    if len(ids) != len(words) + 2:
        raise ValueError(f"tokenizer does not map every word of {prompt!r} to one token")
    nouns = {*SHAPES, *(s + "s" for s in SHAPES)}
    return [i + 1 for i, w in enumerate(words) if w in nouns]


def _encode(tokenizer, prompts: list[str]) -> dict:
    return tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length,
                     truncation=True, return_tensors="pt")


def _forward(encoder, tokenizer, heads, prompts: list[str], labels: list[dict], positions: list[list[int]]):
    """(loss, per-noun all-heads-correct [M], per-prompt pooled all-heads-correct [N])."""
    noun_heads, pooled_heads = heads
    tok = _encode(tokenizer, prompts)
    out = encoder(input_ids=tok["input_ids"], output_hidden_states=True)
    per_token = out.hidden_states[-2]
    rows, cols, noun_y = [], [], []
    for r, (pos, lab) in enumerate(zip(positions, labels)):
        for p, y in zip(pos, lab["nouns"]):
            rows.append(r), cols.append(p), noun_y.append(y)
    noun_h = per_token[torch.tensor(rows), torch.tensor(cols)]
    noun_y = torch.tensor(noun_y)
    pooled_y = torch.tensor([lab["pooled"] for lab in labels])
    noun_logits = [h(noun_h) for h in noun_heads]
    pooled_logits = [h(out.text_embeds) for h in pooled_heads]
    loss = sum(F.cross_entropy(lg, noun_y[:, k]) for k, lg in enumerate(noun_logits))
    loss = loss + sum(F.cross_entropy(lg, pooled_y[:, k]) for k, lg in enumerate(pooled_logits))
    noun_ok = torch.stack([lg.argmax(-1) == noun_y[:, k] for k, lg in enumerate(noun_logits)]).all(0)
    pooled_ok = torch.stack([lg.argmax(-1) == pooled_y[:, k] for k, lg in enumerate(pooled_logits)]).all(0)
    return loss, noun_ok, pooled_ok


def train_text_encoder(encoder, tokenizer, prompts: list[str], *, steps: int = 400, batch: int = 128,
                       lr: float = 3e-3, seed: int = 0, eval_prompts: list[str] | None = None) -> dict:
    """Train ``encoder`` (CLIPTextModelWithProjection) in place on the scene-parsing objective (AdamW,
    seeded minibatches of ``prompts``); returns the final loss and parse accuracies (every head right)
    on ``prompts`` and, if given, on ``eval_prompts`` (``eval_noun_acc``, ``eval_pooled_acc``)."""
    hidden, proj = encoder.config.hidden_size, encoder.config.projection_dim
    torch.manual_seed(seed)
    heads = (torch.nn.ModuleList(torch.nn.Linear(hidden, n) for _, n in NOUN_HEADS),
             torch.nn.ModuleList(torch.nn.Linear(proj, n) for _, n in POOLED_HEADS))
    params = list(encoder.parameters()) + list(heads[0].parameters()) + list(heads[1].parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    labels = [scene_labels(parse_prompt(p)) for p in prompts]
    positions = [noun_positions(tokenizer, p) for p in prompts]
    rng = random.Random(seed)
    encoder.train()
    for _ in range(steps):
        idx = rng.sample(range(len(prompts)), min(batch, len(prompts)))
        loss, _, _ = _forward(encoder, tokenizer, heads, [prompts[i] for i in idx], [labels[i] for i in idx],
                              [positions[i] for i in idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    encoder.eval()
    with torch.no_grad():
        loss, noun_ok, pooled_ok = _forward(encoder, tokenizer, heads, prompts, labels, positions)
        stats = {"loss": float(loss), "noun_acc": float(noun_ok.float().mean()),
                 "pooled_acc": float(pooled_ok.float().mean())}
        if eval_prompts:
            ev_labels = [scene_labels(parse_prompt(p)) for p in eval_prompts]
            ev_pos = [noun_positions(tokenizer, p) for p in eval_prompts]
            _, noun_ok, pooled_ok = _forward(encoder, tokenizer, heads, eval_prompts, ev_labels, ev_pos)
            stats.update(eval_noun_acc=float(noun_ok.float().mean()), eval_pooled_acc=float(pooled_ok.float().mean()))
    return stats


def switch_off_t5(encoder) -> None:
    """Make a T5EncoderModel return zeros (final RMSNorm scale 0), as SD3 does with T5 dropped."""
    with torch.no_grad():
        encoder.encoder.final_layer_norm.weight.zero_()
