"""SD3 config mapping, weight map, registry and provider helpers: pure functions, CPU, 1 process,
no process group (diffusers is used for a real state dict)."""
from __future__ import annotations

import pytest
import torch

from megaflow.models import provider, registry
from megaflow.models.sd3 import config as sd3_config
from megaflow.models.sd3 import from_diffusers, tiny, weight_map


@pytest.fixture(scope="module")
def sd35():
    """(diffusers config, state dict) of a tiny SD3.5-style model: qk norm + 2 dual-attention blocks."""
    torch.set_num_threads(1)
    dcfg = tiny.tiny_config(qk_norm="rms_norm", dual_attention_layers=(0, 2))
    return dcfg, tiny.diffusers_model(dcfg).state_dict()


def test_config_mapping_roundtrip():
    dcfg = tiny.tiny_config(qk_norm="rms_norm", dual_attention_layers=(1,))
    cfg = from_diffusers({**dcfg, "_class_name": "SD3Transformer2DModel", "_diffusers_version": "0.37.0"},
                         tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert (cfg.hidden_size, cfg.kv_channels, cfg.ffn_hidden_size) == (32, 8, 128)
    assert cfg.qk_layernorm and cfg.normalization == "RMSNorm" and cfg.layernorm_epsilon == 1e-6
    assert cfg.pipeline_dtype == torch.float32 and cfg.tensor_model_parallel_size == 2
    back = sd3_config.to_diffusers(cfg)
    assert back["_diffusers_version"] == "0.37.0"
    assert {k: back[k] for k in dcfg} == {**dcfg, "dual_attention_layers": [1]}


@pytest.mark.parametrize("bad, message", [
    ({"no_such_key": 1}, "no_such_key"),
    ({"caption_projection_dim": 48}, "caption_projection_dim=48"),
    ({"qk_norm": "layer_norm"}, "layer_norm"),
    ({"dual_attention_layers": (7,)}, "[7]"),
])
def test_config_errors_name_the_value(bad, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        from_diffusers({**tiny.tiny_config(), **bad})


def test_fuse_qkv_interleaves_per_head_and_inverts():
    q, k, v = (torch.arange(12.0).reshape(4, 3) + 100 * i for i in range(3))  # 2 heads x head_dim 2
    fused = weight_map.fuse_qkv(q, k, v, num_heads=2)
    assert torch.equal(fused[:6], torch.cat([q[:2], k[:2], v[:2]]))  # head 0: q, k, v rows
    assert all(torch.equal(a, b) for a, b in zip(weight_map.unfuse_qkv(fused, 2), (q, k, v)))


def test_roundtrip_bit_exact_and_tables(sd35):
    dcfg, state = sd35
    cfg = from_diffusers(dcfg)
    full = weight_map.to_megatron_full(state, cfg)
    back = weight_map.to_diffusers(full, cfg)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert "layers.3.attention.context_linear_proj.weight" not in full  # context_pre_only block
    assert "layers.2.attention2.q_layernorm.weight" in full and "layers.1.attention2.linear_qkv.weight" not in full
    assert weight_map.split_dim(cfg, "layers.0.attention.linear_qkv.weight") == 0
    assert weight_map.split_dim(cfg, "layers.0.mlp.linear_fc2.weight") == 1
    assert weight_map.split_dim(cfg, "layers.0.mlp.linear_fc2.bias") is None
    streamed = weight_map.megatron_to_diffusers("layers.1.attention.linear_qkv.weight", full["layers.1.attention.linear_qkv.weight"], cfg)
    assert [n for n, _ in streamed] == [f"transformer_blocks.1.attn.to_{x}.weight" for x in "qkv"]


def test_local_shards_tp_and_pp(sd35):
    dcfg, state = sd35
    cfg = from_diffusers(dcfg, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    full = weight_map.to_megatron_full(state, from_diffusers(dcfg))
    first = weight_map.to_megatron(state, cfg, tp_rank=1, tp_size=2, pp_rank=0)
    last = weight_map.to_megatron(state, cfg, tp_rank=0, tp_size=2, pp_rank=1)
    assert "patch_embed.proj.weight" in first and "final_proj.weight" not in first
    assert "final_proj.weight" in last and "patch_embed.proj.weight" not in last
    # stage 1 holds global blocks 2, 3 as local 0, 1; TP rank 1 holds the second half of the heads
    assert torch.equal(last["layers.0.mlp.linear_fc1.weight"], full["layers.2.mlp.linear_fc1.weight"][:64])
    assert torch.equal(first["layers.1.attention.linear_qkv.weight"], full["layers.1.attention.linear_qkv.weight"][48:])
    assert torch.equal(first["layers.0.attention.linear_proj.weight"], full["layers.0.attention.linear_proj.weight"][:, 16:])


def test_registry_and_provider_errors():
    assert registry.get_family("sd3").diffusers_class == "SD3Transformer2DModel"
    with pytest.raises(ValueError, match="'nope'"):
        registry.get_family("nope")
    with pytest.raises(ValueError, match="bad model.spec path 'no_colon'"):
        provider.load_callable("no_colon")
    with pytest.raises(ValueError, match="no attribute"):
        provider.load_callable("megaflow.models.sd3.spec:missing_fn")
    assert provider.load_callable("megaflow.models.sd3.spec:get_mmdit_layer_spec") is not None
