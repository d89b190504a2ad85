"""FLUX config mapping, weight map (fused single-block layouts, TP/PP shards), RoPE helpers and the
registry entry: pure functions, CPU, 1 process, no process group (diffusers supplies real state
dicts and the RoPE reference)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megaflow.models import registry
from megaflow.models.flux import FluxTransformer, from_diffusers, model_inputs, tiny, weight_map
from megaflow.models.flux import config as flux_config
from megaflow.models.flux.layers import apply_rope, rope_table
from megaflow.models.flux.model import image_ids, sp_joint_order


@pytest.fixture(scope="module")
def dev():
    """(diffusers config, state dict) of a tiny FLUX.1-dev-like model (guidance embedding)."""
    torch.set_num_threads(1)
    dcfg = tiny.tiny_config(guidance_embeds=True)
    return dcfg, tiny.diffusers_model(dcfg).state_dict()


def test_config_mapping_roundtrip():
    dcfg = tiny.tiny_config()
    cfg = from_diffusers({**dcfg, "_class_name": "FluxTransformer2DModel", "_diffusers_version": "0.37.0"},
                         tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert (cfg.hidden_size, cfg.kv_channels, cfg.ffn_hidden_size, cfg.num_layers) == (32, 8, 128, 4)
    assert (cfg.num_double_layers, cfg.num_single_layers, cfg.mlp_per_head, cfg.patch_dim) == (2, 2, 32, 16)
    assert cfg.qk_layernorm and cfg.layernorm_epsilon == 1e-6 and cfg.pipeline_dtype == torch.float32
    assert [cfg.is_single(i) for i in range(4)] == [False, False, True, True]
    back = flux_config.to_diffusers(cfg)
    assert back["_diffusers_version"] == "0.37.0" and back["out_channels"] == 16
    assert {k: back[k] for k in dcfg} == {**dcfg, "axes_dims_rope": [2, 2, 4]}


@pytest.mark.parametrize("bad, message", [
    ({"no_such_key": 1}, "no_such_key"),
    ({"axes_dims_rope": (2, 2, 2)}, r"axes_dims_rope=\(2, 2, 2\)"),
    ({"axes_dims_rope": (3, 1, 4)}, r"axes_dims_rope=\(3, 1, 4\)"),
])
def test_config_errors_name_the_value(bad, message):
    with pytest.raises(ValueError, match=message):
        from_diffusers({**tiny.tiny_config(), **bad})


def test_interleave_heads_layout_and_inverse():
    q, k, v = (torch.arange(4.0) + 10 * i for i in range(3))  # 2 heads x head_dim 2
    m = torch.arange(6.0) + 100  # 2 heads x 3 mlp channels
    fused = weight_map.interleave_heads([q, k, v, m], num_heads=2)
    assert fused.tolist() == [0, 1, 10, 11, 20, 21, 100, 101, 102, 2, 3, 12, 13, 22, 23, 103, 104, 105]
    assert all(torch.equal(a, b) for a, b in zip(weight_map.split_heads(fused, [4, 4, 4, 6], 2), (q, k, v, m)))
    w = torch.arange(20.0).reshape(2, 10)  # proj_out [h=2, attn 4 | mlp 6] -> columns per head
    cols = weight_map.interleave_heads([w[:, :4], w[:, 4:]], 2, dim=1)
    assert cols[0].tolist() == [0, 1, 4, 5, 6, 2, 3, 7, 8, 9]
    with pytest.raises(ValueError, match="not divisible by 4 heads"):
        weight_map.interleave_heads([q, torch.zeros(6)], num_heads=4)


@pytest.mark.parametrize("guidance", [True, False])
def test_roundtrip_bit_exact_and_tables(guidance, dev):
    dcfg = tiny.tiny_config(guidance_embeds=guidance)
    state = dev[1] if guidance else tiny.diffusers_model(dcfg).state_dict()
    cfg = from_diffusers(dcfg)
    full = weight_map.to_megatron_full(state, cfg)
    back = weight_map.to_diffusers(full, cfg)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert ("guidance_embed.linear_1.weight" in full) == guidance
    assert full["layers.2.linear_qkv_mlp.weight"].shape == (4 * (3 * 8 + 32), 32)
    assert full["layers.3.linear_proj.weight"].shape == (32, 4 * (8 + 32))
    assert "layers.2.attention.linear_qkv.weight" not in full  # block 2 is single-stream
    for name, dim in [("layers.0.attention.linear_qkv.weight", 0), ("layers.1.mlp.linear_fc2.weight", 1),
                      ("layers.2.linear_qkv_mlp.bias", 0), ("layers.2.linear_proj.weight", 1),
                      ("layers.2.linear_proj.bias", None), ("layers.3.q_layernorm.weight", None)]:
        assert weight_map.split_dim(cfg, name) == dim, name
    streamed = weight_map.megatron_to_diffusers("layers.3.linear_qkv_mlp.weight", full["layers.3.linear_qkv_mlp.weight"], cfg)
    prefix = "single_transformer_blocks.1."
    assert [n for n, _ in streamed] == [prefix + s for s in ("attn.to_q.weight", "attn.to_k.weight",
                                                            "attn.to_v.weight", "proj_mlp.weight")]


def test_tp_shards_compute_the_diffusers_single_block(dev):
    """A TP rank's shards of the fused single-block linears compute exactly its heads' q/k/v and its
    slice of proj_mlp, and the sum over ranks of the partial proj outputs is diffusers' proj_out."""
    dcfg, state = dev
    cfg = from_diffusers(dcfg, tensor_model_parallel_size=2)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    p = "single_transformer_blocks.0."
    lin = {n: F.linear(x, state[f"{p}{n}.weight"], state[f"{p}{n}.bias"])
           for n in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}
    attn_in, mlp_in = torch.randn(5, 32), torch.randn(5, 128)
    partial_sum = 0
    for r in range(2):
        local = weight_map.to_megatron(state, cfg, tp_rank=r, tp_size=2)
        fused = F.linear(x, local["layers.2.linear_qkv_mlp.weight"], local["layers.2.linear_qkv_mlp.bias"])
        q, k, v, m = fused.view(5, 2, 56).split([8, 8, 8, 32], dim=-1)
        heads = slice(16 * r, 16 * (r + 1))
        for got, name in ((q, "attn.to_q"), (k, "attn.to_k"), (v, "attn.to_v")):
            torch.testing.assert_close(got.reshape(5, 16), lin[name][:, heads], rtol=0, atol=1e-6)
        torch.testing.assert_close(m.reshape(5, 64), lin["proj_mlp"][:, 64 * r:64 * (r + 1)], rtol=0, atol=1e-6)
        mixed = torch.cat([attn_in[:, heads].view(5, 2, 8), mlp_in[:, 64 * r:64 * (r + 1)].view(5, 2, 32)], -1)
        partial_sum = partial_sum + F.linear(mixed.view(5, -1), local["layers.2.linear_proj.weight"])
    expected = F.linear(torch.cat([attn_in, mlp_in], -1), state[f"{p}proj_out.weight"])
    torch.testing.assert_close(partial_sum, expected, rtol=0, atol=1e-6)


def test_local_shards_pp(dev):
    dcfg, state = dev
    cfg = from_diffusers(dcfg, pipeline_model_parallel_size=2)
    full = weight_map.to_megatron_full(state, from_diffusers(dcfg))
    first = weight_map.to_megatron(state, cfg, pp_rank=0)
    last = weight_map.to_megatron(state, cfg, pp_rank=1)
    assert "guidance_embed.linear_2.bias" in first and "final_proj.weight" not in first
    assert "final_proj.weight" in last and "x_embed.weight" not in last
    # stage 1 holds global (single-stream) blocks 2, 3 as local 0, 1
    assert torch.equal(last["layers.1.linear_proj.weight"], full["layers.3.linear_proj.weight"])
    assert "layers.1.context_mlp.linear_fc1.weight" in first


def test_guidance_weights_need_a_guidance_config(dev):
    """Dev weights with a schnell config: the guidance embedder is named as unexpected (the other
    weight-map errors are tested for every family in test_common_weight_map.py)."""
    _, state = dev
    with pytest.raises(ValueError, match="time_text_embed.guidance_embedder"):
        weight_map.to_megatron_full(state, from_diffusers(tiny.tiny_config(guidance_embeds=False)))


def test_rope_matches_diffusers_bit_exact():
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.randint(0, 8, (6, 3), generator=g).float(), image_ids(4, 4)])
    cos, sin = rope_table(ids, (2, 2, 4), 10000)
    ref_cos, ref_sin = FluxPosEmbed(theta=10000, axes_dim=[2, 2, 4])(ids)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    x = torch.randn(2, 22, 4, 8, generator=g)  # diffusers layout [b, s, heads, d]
    ref = apply_rotary_emb(x, (ref_cos, ref_sin), sequence_dim=1)
    assert torch.equal(apply_rope(x.transpose(0, 1), (cos, sin)).transpose(0, 1), ref)


def test_sp_joint_order():
    # 4 context + 6 image tokens on 2 ranks: gathered [ctx_0; img_0; ctx_1; img_1]
    assert sp_joint_order(4, 6, 2).tolist() == [0, 1, 4, 5, 6, 2, 3, 7, 8, 9]


def test_registry_spec_and_inputs():
    fam = registry.get_family("flux")
    assert fam.diffusers_class == "FluxTransformer2DModel" and fam.weight_map is weight_map
    assert "flux" in registry.family_names()
    from megaflow.models.sd3.spec import get_mmdit_layer_spec

    with pytest.raises(ValueError, match=r"\.double and \.single"):
        FluxTransformer(from_diffusers(tiny.tiny_config()), get_mmdit_layer_spec("local"))
    mb = {k: torch.zeros(1) for k in ("latents", "sigma", "encoder_hidden_states", "pooled_projections",
                                      "txt_ids", "img_ids")}
    kwargs = model_inputs(from_diffusers(tiny.tiny_config()), mb)
    assert kwargs["hidden_states"] is mb["latents"] and kwargs["timestep"] is mb["sigma"] and kwargs["guidance"] is None
