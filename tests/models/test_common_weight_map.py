"""The generic weight map (megaflow.models.common.weight_map) through each family's table: errors
name the offending tensor. Pure functions, CPU, 1 process, no process group (diffusers supplies
real state dicts)."""
from __future__ import annotations

import importlib
import re

import pytest
import torch

from megaflow.models import registry

# family -> (tiny diffusers config kwargs, a diffusers tensor only that family's table maps)
CASES = {
    "sd3": (dict(qk_norm="rms_norm", dual_attention_layers=(0, 2)), "transformer_blocks.2.attn2.norm_k.weight"),
    "flux": (dict(guidance_embeds=True), "single_transformer_blocks.1.proj_mlp.bias"),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    """(family, megatron config, diffusers state dict, a family-specific diffusers tensor name)."""
    torch.set_num_threads(1)
    fam = registry.get_family(request.param)
    tiny = importlib.import_module(f"megaflow.models.{request.param}.tiny")
    kwargs, name = CASES[request.param]
    dcfg = tiny.tiny_config(**kwargs)
    return fam, fam.config_from_diffusers(dcfg), tiny.diffusers_model(dcfg).state_dict(), name


def test_weight_errors_name_the_tensor(case):
    fam, cfg, state, name = case
    wm = fam.weight_map
    with pytest.raises(ValueError, match=re.escape(name)):
        wm.to_megatron_full({k: v for k, v in state.items() if k != name}, cfg)
    with pytest.raises(ValueError, match="extra.weight"):
        wm.to_megatron_full({**state, "extra.weight": torch.zeros(1)}, cfg)
    full = wm.to_megatron_full(state, cfg)
    with pytest.raises(ValueError, match="final_proj.bias"):
        wm.to_diffusers({k: v for k, v in full.items() if k != "final_proj.bias"}, cfg)
    with pytest.raises(ValueError, match="unexpected megatron tensor 'extra.weight'"):
        wm.to_diffusers({**full, "extra.weight": torch.zeros(1)}, cfg)
    for fn in (lambda n: wm.megatron_to_diffusers(n, torch.zeros(1), cfg), lambda n: wm.split_dim(cfg, n)):
        with pytest.raises(ValueError, match="'layers.9.adaln.weight'"):
            fn("layers.9.adaln.weight")


def test_local_shards_cover_the_full_tensors(case):
    """TP=2 x PP=2: every rank's local tensors, put back together over TP and renumbered to global
    block indices, are exactly the full tensors, each held by exactly one stage."""
    fam, cfg, state, _ = case
    wm = fam.weight_map
    full = wm.to_megatron_full(state, cfg)
    par = fam.config_from_diffusers(fam.config_to_diffusers(cfg), tensor_model_parallel_size=2,
                                    pipeline_model_parallel_size=2)
    seen = {}
    for pp_rank in range(2):
        locals_ = [wm.to_megatron(state, par, tp_rank=r, tp_size=2, pp_rank=pp_rank) for r in range(2)]
        start = wm.stage_layers(par, pp_rank).start
        for local_name in locals_[0]:
            name = re.sub(r"^layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + start}.", local_name)
            dim = wm.split_dim(cfg, name)
            parts = [loc[local_name] for loc in locals_]
            assert name not in seen, name
            seen[name] = parts[0] if dim is None else torch.cat(parts, dim=dim)
    assert seen.keys() == full.keys()
    assert all(torch.equal(seen[k], full[k]) for k in full)
