"""ShapeEval prompt grammar, categories and the seeded train/eval split. Needs: CPU, 1 process."""

import numpy as np
import pytest

from megaflow.data.shapes import (BACKGROUND, CATEGORIES, HELD_OUT_CATEGORIES, PALETTE, SEEN_CATEGORIES, Group, Scene,
                                  _attributes, _universe, category_of, parse_prompt, relation_holds, sample_prompts,
                                  sample_scenes, split_prompts)


def test_every_scene_round_trips_through_its_prompt_and_category():
    for cat in CATEGORIES:
        scenes = _universe(cat)
        assert len({s.prompt for s in scenes}) == len(scenes), f"duplicate prompts in {cat}"
        for scene in scenes:
            assert parse_prompt(scene.prompt) == scene
            assert category_of(scene) == cat


def test_prompt_text_examples():
    scene = Scene(groups=(Group(shape="circle", color="red", count=2), Group(shape="square", color="blue")),
                  relation="left of")
    assert scene.prompt == "two red circles left of a blue square"
    assert parse_prompt("  Two RED circles left of a blue square. ") == scene
    assert category_of(parse_prompt("three triangles")) == "counting"
    assert category_of(parse_prompt("a circle and a square")) == "two_object"


@pytest.mark.parametrize("bad", ["a red dog", "two red circle", "a circles", "a circle and a circle",
                                 "a red circle near a square", "", "five circles"])
def test_parse_rejects_text_outside_the_grammar(bad):
    with pytest.raises(ValueError, match="ShapeEval prompt"):
        parse_prompt(bad)


def test_split_is_disjoint_complete_and_seeded():
    a, b, c = split_prompts(seed=0), split_prompts(seed=0), split_prompts(seed=1)
    assert a == b
    assert a.eval != c.eval
    for cat in HELD_OUT_CATEGORIES:
        train, held = set(a.train[cat]), set(a.eval[cat])
        assert train and held and not train & held
        assert train | held == set(_universe(cat))
    for cat in SEEN_CATEGORIES:  # too small to split: trained on and reported apart
        assert set(a.train[cat]) == set(a.eval[cat]) == set(_universe(cat))


def test_held_out_prompts_are_new_combinations_of_seen_words():
    split = split_prompts(seed=0)
    sizes = {c: len(split.eval[c]) for c in HELD_OUT_CATEGORIES}
    assert sizes == {"colors": 6, "counting": 3, "color_attr": 45, "position": 8, "composite": 1530}
    for cat in HELD_OUT_CATEGORIES:
        seen = set().union(*(_attributes(s) for s in split.train[cat]))
        for scene in split.eval[cat]:
            assert _attributes(scene) <= seen, f"{scene.prompt!r} uses a word its category never trains"


def test_samples_are_balanced_deterministic_and_held_out():
    prompts = sample_prompts("eval", 50, seed=5, categories=HELD_OUT_CATEGORIES)
    assert prompts == sample_prompts("eval", 50, seed=5, categories=HELD_OUT_CATEGORIES)
    assert prompts != sample_prompts("eval", 50, seed=6, categories=HELD_OUT_CATEGORIES)
    train = {s.prompt for c in HELD_OUT_CATEGORIES for s in split_prompts().train[c]}
    assert not set(prompts) & train
    cats = [category_of(s) for s in sample_scenes("eval", 70, seed=5)]
    assert all(cats.count(c) == 10 for c in CATEGORIES)
    with pytest.raises(ValueError, match="split"):
        sample_scenes("test", 3)


def test_palette_is_well_separated_from_itself_and_the_background():
    rgb = np.array(list(PALETTE.values()) + [BACKGROUND], dtype=float)
    d = np.linalg.norm(rgb[:, None] - rgb[None], axis=-1)
    assert d[~np.eye(len(rgb), dtype=bool)].min() > 120


def test_relation_predicate():
    res = 32
    assert relation_holds((5, 16), (20, 16), "left of", res)
    assert relation_holds((20, 16), (5, 16), "right of", res)
    assert relation_holds((16, 4), (16, 25), "above", res)
    assert relation_holds((16, 25), (16, 4), "below", res)
    assert not relation_holds((5, 16), (6, 16), "left of", res)  # under the 10% margin
    assert not relation_holds((5, 0), (15, 30), "left of", res)  # vertical offset dominates
    assert not relation_holds((5, 16), (20, 16), "left of", res, slack=12.0)
