"""ShapeEval text encoders: whole-word tokenizers, the scene-parsing objective, T5 switched off. Needs: CPU, 1 process."""
import torch

from megaflow.data.shapes import CATEGORIES, parse_prompt, shapes_vocabulary, split_prompts
from megaflow.models.sd3 import shapes as kit
from megaflow.models.sd3.shapes import text_components
from megaflow.models.tiny_pipeline import _WORDS, make_clip_tokenizer
from megaflow.pretrain.text import noun_positions, scene_labels, train_text_encoder


def test_every_word_is_one_token_in_every_tokenizer():
    for words in (shapes_vocabulary(), _WORDS):
        tok = make_clip_tokenizer(words)
        for w in words:
            assert len(tok(w)["input_ids"]) == 3, w  # start, word, end
    tok, _, tok3, *_ = text_components(seed=0)
    for w in shapes_vocabulary():
        assert len(tok3(w)["input_ids"]) == 2, w  # word, </s>


def test_labels_follow_the_scene():
    lab = scene_labels(parse_prompt("two red circles left of a blue square"))
    # noun of group 0: circle, red, count 2, group 0; noun of group 1: square, blue, 1, group 1, relation "left of"
    assert lab["nouns"] == [[0, 1, 1, 0, 0], [1, 3, 0, 1, 2]]
    assert lab["pooled"] == [0, 1, 1, 1, 3, 0, 2]
    tok = make_clip_tokenizer(shapes_vocabulary())
    assert noun_positions(kit, tok, "two red circles left of a blue square") == [3, 8]


def test_text_encoder_learns_the_grammar_and_generalises():
    """Trained on TRAIN prompts only, it parses held-out prompts (new combinations) too."""
    torch.manual_seed(0)
    split = split_prompts(seed=0)
    train = [s.prompt for c in CATEGORIES for s in split.train[c]][::4]
    held = [s.prompt for c in ("colors", "color_attr", "position", "composite") for s in split.eval[c]][:300]
    tok, _, _, enc, _, _ = text_components(seed=0)
    stats = train_text_encoder(kit, enc, tok, train, steps=150, batch=64, eval_prompts=held)
    assert stats["noun_acc"] > 0.95 and stats["pooled_acc"] > 0.9, stats
    assert stats["eval_noun_acc"] > 0.9 and stats["eval_pooled_acc"] > 0.8, stats


def test_t5_switched_off_returns_zeros():
    text = text_components(seed=0)
    tok3, t5 = text[2], text[5]
    kit.finish_text(text)
    out = t5(tok3(["a red circle"], return_tensors="pt").input_ids).last_hidden_state
    assert out.abs().max() == 0
