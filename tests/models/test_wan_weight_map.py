"""Wan config mapping, weight map (fused QKV / KV, heads-split q/k norm scales, TP/PP shards), the 3-D rotary
table, the latent-grid checks, the microbatch functions and the registry entry: pure functions, CPU, 1 process,
no process group (diffusers supplies real state dicts and the rotary reference)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megaflow.models import registry
from megaflow.models.wan import WanTransformer, from_diffusers, model_inputs, tiny, weight_map
from megaflow.models.wan import config as wan_config
from megaflow.models.wan.model import batch_conditioning, grid_ids, latent_grid, microbatch_seq_length
from megaflow.models.common.rope import rope_table


@pytest.fixture(scope="module")
def t2v():
    """(diffusers config, state dict) of a tiny Wan T2V transformer."""
    torch.set_num_threads(1)
    dcfg = tiny.tiny_config()
    return dcfg, tiny.diffusers_model(dcfg).state_dict()


def test_config_mapping_roundtrip():
    dcfg = {**tiny.tiny_config(), "_class_name": "WanTransformer3DModel", "_diffusers_version": "0.37.0",
            "image_dim": None, "added_kv_proj_dim": None, "pos_embed_seq_len": None}
    cfg = from_diffusers(dcfg, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert (cfg.hidden_size, cfg.kv_channels, cfg.ffn_hidden_size, cfg.num_layers) == (32, 8, 64, 2)
    assert cfg.patch_size == (1, 2, 2) and cfg.patch_dim == 16 and cfg.rope_axes == (4, 2, 2)
    assert cfg.layernorm_epsilon == 1e-6 and cfg.pipeline_dtype == torch.float32
    back = wan_config.to_diffusers(cfg)
    assert back == {**dcfg, "patch_size": [1, 2, 2]}
    assert from_diffusers({"num_attention_heads": 40, "attention_head_dim": 128}).rope_axes == (44, 42, 42)


@pytest.mark.parametrize("bad, message", [
    ({"no_such_key": 1}, "no_such_key"),
    ({"image_dim": 1280}, "image_dim=1280: only text-to-video"),
    ({"added_kv_proj_dim": 32}, "added_kv_proj_dim=32"),
    ({"qk_norm": "rms_norm"}, "qk_norm='rms_norm' is not supported"),
    ({"patch_size": (2, 2)}, r"patch_size=\(2, 2\)"),
    ({"attention_head_dim": 4, "num_attention_heads": 8}, "attention_head_dim=4"),
    ({"attention_head_dim": 9}, "attention_head_dim=9"),
])
def test_config_errors_name_the_value(bad, message):
    with pytest.raises(ValueError, match=message):
        from_diffusers({**tiny.tiny_config(), **bad})


def test_qk_layernorm_flag_is_refused():
    """megatron sums the grads of params named *q_layernorm* over TP when qk_layernorm is set: wrong for Wan's
    heads-split scales, so the flag is refused."""
    with pytest.raises(ValueError, match="qk_layernorm=True is not supported"):
        from_diffusers(tiny.tiny_config(), qk_layernorm=True)


@pytest.mark.parametrize("cross_attn_norm", [True, False])
def test_roundtrip_bit_exact_and_tables(cross_attn_norm, t2v):
    dcfg = tiny.tiny_config(cross_attn_norm=cross_attn_norm)
    state = t2v[1] if cross_attn_norm else tiny.diffusers_model(dcfg).state_dict()
    cfg = from_diffusers(dcfg)
    full = weight_map.to_megatron_full(state, cfg)
    back = weight_map.to_diffusers(full, cfg)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert ("layers.1.cross_norm.weight" in full) == cross_attn_norm
    assert full["layers.0.scale_shift_table"].shape == (1, 6, 32) and full["final.scale_shift_table"].shape == (1, 2, 32)
    assert full["patch_embed.weight"].shape == (32, 4, 1, 2, 2)
    for name, dim in [("layers.0.self_attention.linear_qkv.weight", 0), ("layers.0.self_attention.q_layernorm.weight", 0),
                      ("layers.1.cross_attention.linear_kv.bias", 0), ("layers.1.cross_attention.k_layernorm.weight", 0),
                      ("layers.1.cross_attention.linear_proj.weight", 1), ("layers.1.mlp.linear_fc2.bias", None),
                      ("layers.0.scale_shift_table", None), ("final.proj.weight", None), ("time_proj.weight", None)]:
        assert weight_map.split_dim(cfg, name) == dim, name
    streamed = weight_map.megatron_to_diffusers("layers.1.cross_attention.linear_kv.weight",
                                                full["layers.1.cross_attention.linear_kv.weight"], cfg)
    assert [n for n, _ in streamed] == ["blocks.1.attn2.to_k.weight", "blocks.1.attn2.to_v.weight"]


def test_tp_shards_hold_their_heads(t2v):
    """A TP rank's fused KV computes exactly its heads' k and v (per head [k | v]), and its q/k norm scales
    are its heads' slice of diffusers' all-heads scale."""
    dcfg, state = t2v
    cfg = from_diffusers(dcfg, tensor_model_parallel_size=2)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    p = "blocks.0.attn2."
    k_ref, v_ref = (F.linear(x, state[f"{p}{n}.weight"], state[f"{p}{n}.bias"]) for n in ("to_k", "to_v"))
    for r in range(2):
        local = weight_map.to_megatron(state, cfg, tp_rank=r, tp_size=2)
        kv = F.linear(x, local["layers.0.cross_attention.linear_kv.weight"], local["layers.0.cross_attention.linear_kv.bias"])
        k, v = kv.view(5, 2, 16).split(8, dim=-1)
        heads = slice(16 * r, 16 * (r + 1))
        torch.testing.assert_close(k.reshape(5, 16), k_ref[:, heads], rtol=0, atol=1e-6)
        torch.testing.assert_close(v.reshape(5, 16), v_ref[:, heads], rtol=0, atol=1e-6)
        assert torch.equal(local["layers.0.self_attention.k_layernorm.weight"], state["blocks.0.attn1.norm_k.weight"][heads])


def test_local_shards_pp(t2v):
    dcfg, state = t2v
    cfg = from_diffusers(dcfg, pipeline_model_parallel_size=2)
    full = weight_map.to_megatron_full(state, from_diffusers(dcfg))
    first, last = weight_map.to_megatron(state, cfg, pp_rank=0), weight_map.to_megatron(state, cfg, pp_rank=1)
    assert "time_proj.weight" in first and "final.proj.weight" not in first and "layers.1.mlp.linear_fc1.weight" not in first
    assert "final.scale_shift_table" in last and "patch_embed.weight" not in last
    assert torch.equal(last["layers.0.scale_shift_table"], full["layers.1.scale_shift_table"])


def test_rope_matches_diffusers_bit_exact():
    """The (time, height, width) table of a 3 x 2 x 3 token grid equals diffusers' WanRotaryPosEmbed's."""
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    cfg = from_diffusers(tiny.tiny_config(attention_head_dim=16))
    cos, sin = rope_table(grid_ids((3, 2, 3)), cfg.rope_axes, wan_config.ROPE_THETA)
    ref_cos, ref_sin = WanRotaryPosEmbed(16, (1, 2, 2), 32)(torch.zeros(1, 4, 3, 4, 6))
    assert cfg.rope_axes == (8, 4, 4)
    assert torch.equal(cos, ref_cos[0, :, 0]) and torch.equal(sin, ref_sin[0, :, 0])


def test_latent_grid_checks():
    cfg = from_diffusers(tiny.tiny_config())
    assert latent_grid(cfg, (2, 4, 3, 4, 6)) == (3, 2, 3)
    assert grid_ids((2, 1, 2)).tolist() == [[0, 0, 0], [0, 0, 1], [1, 0, 0], [1, 0, 1]]
    with pytest.raises(ValueError, match=r"\[B, C, F, H, W\].*\(2, 4, 4, 6\)"):
        latent_grid(cfg, (2, 4, 4, 6))
    with pytest.raises(ValueError, match="latent width 5 is not divisible by patch size 2"):
        latent_grid(cfg, (2, 4, 3, 4, 5))
    with pytest.raises(ValueError, match="exceeds rope_max_seq_len=32"):
        latent_grid(cfg, (1, 4, 33, 4, 4))


class _Traj:
    def __init__(self, value: float, cfg: bool):
        self.request_id, self.index = "r", 0
        self.conditioning = {"encoder_hidden_states": torch.full((6, 24), value)}
        if cfg:
            self.conditioning["negative_encoder_hidden_states"] = torch.full((6, 24), -value)


def test_microbatch_functions():
    cfg = from_diffusers(tiny.tiny_config())
    mb = {"latents": torch.zeros(2, 4, 3, 4, 6), "sigma": torch.tensor([0.25, 0.5]),
          "encoder_hidden_states": torch.zeros(2, 6, 24)}
    kwargs = model_inputs(cfg, mb)
    assert kwargs["hidden_states"] is mb["latents"] and kwargs["timestep"].tolist() == [250.0, 500.0]
    assert set(kwargs) == {"hidden_states", "timestep", "encoder_hidden_states"}
    assert microbatch_seq_length(cfg, mb) == 18 + 6 + 7
    sp = from_diffusers(tiny.tiny_config(), tensor_model_parallel_size=2, sequence_parallel=True)
    assert microbatch_seq_length(sp, mb) == 18 + 6 + 14  # the schedule divides by tp: 9 + 3 + 7 rows per rank
    cond = batch_conditioning(cfg, [_Traj(1.0, True), _Traj(2.0, True)], True)["encoder_hidden_states"]
    assert cond[:, 0, 0].tolist() == [-1.0, -2.0, 1.0, 2.0]  # [negative; positive]
    with pytest.raises(ValueError, match="negative_encoder_hidden_states"):
        batch_conditioning(cfg, [_Traj(1.0, False)], True)


def test_registry_entry():
    fam = registry.get_family("wan")
    assert "wan" in registry.family_names()
    assert fam.diffusers_class == "WanTransformer3DModel" and fam.weight_map is weight_map
    assert fam.model_class is WanTransformer and not fam.embedded_guidance
