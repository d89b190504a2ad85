"""The family registry: every card (``megaflow.families``) is read with the standard library only, its name is its
registry key, and the torch part its card names (``megaflow.models.registry.get_family``) agrees with it (name,
diffusers class, guidance); the cards' plan tables against the published configs' own numbers.
Needs: CPU, 1 process; a subprocess without torch (~1 s), then imports torch and megatron (~10 s)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megaflow.families import DEFAULT_FAMILY, card, family_names


def test_cards_import_the_standard_library_only():
    code = ("import sys; before = set(sys.modules); import megaflow.families as f; "
            "[f.card(n) for n in f.family_names()]; "
            "import json; print(json.dumps(sorted({m.split('.')[0] for m in set(sys.modules) - before})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    outside = sorted(set(json.loads(out)) - set(sys.stdlib_module_names) - {"megaflow"})
    assert not outside, f"importing the family cards imported {outside}"


def test_every_card_is_registered_under_its_name():
    names = family_names()
    assert {"sd3", "flux"} <= set(names) and DEFAULT_FAMILY in names, names
    for name in names:
        c = card(name)
        assert c.name == name and c.package == f"megaflow.models.{name}", (name, c.name, c.package)
        assert c.builtin[1]["_class_name"] == c.diffusers_class, name
    with pytest.raises(ValueError, match="unknown model family 'nope'; known: sd3, flux"):
        card("nope")


def test_the_torch_part_agrees_with_its_card():
    from megaflow.models.registry import get_family

    for name in family_names():
        family, c = get_family(name), card(name)
        assert (family.name, family.diffusers_class, family.embedded_guidance) == \
            (c.name, c.diffusers_class, c.embedded_guidance), name


def test_cfg_copies_follow_the_guidance_kind():
    sd3, flux = card("sd3"), card("flux")
    assert [sd3.cfg_copies(g) for g in (1.0, 1.5)] == [1, 2] and [flux.cfg_copies(g) for g in (1.0, 3.5)] == [1, 1]
    assert (sd3.token_side(2), sd3.token_side(1), flux.token_side(1)) == (2, 1, 2)


def test_plan_dims_defaults_are_the_diffusers_classes():
    """A transformer config missing a key plans as the diffusers class builds it: the card's defaults against the
    class's own constructor defaults."""
    import inspect

    import diffusers

    from megaflow.plan.dit import dims_from_config

    for name in family_names():
        cls = getattr(diffusers, card(name).diffusers_class)
        defaults = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
                    if p.default is not inspect.Parameter.empty}
        given = dict(num_attention_heads=2, attention_head_dim=8)
        assert dims_from_config(name, given, "t") == dims_from_config(name, {**defaults, **given}, "t"), name


def test_every_tiny_pipeline_is_a_registered_family():
    from megaflow.models import tiny_pipeline

    assert set(tiny_pipeline.FAMILIES) <= set(family_names()), tiny_pipeline.FAMILIES
