"""Qwen-Image config mapping, weight map (round trip, TP/PP shards), RoPE positions and the registry entry:
pure functions, CPU, 1 process, no process group (diffusers supplies real state dicts, the RoPE reference
and the proof that the tiny batches' padding is really masked)."""
from __future__ import annotations

import pytest
import torch

from megaflow.models import registry
from megaflow.models.common.rope import apply_rope
from megaflow.models.qwen_image import from_diffusers, model_inputs, tiny, weight_map
from megaflow.models.qwen_image import config as qwen_config
from megaflow.models.qwen_image.layers import qwen_rope
from megaflow.models.qwen_image.model import as_img_shape, microbatch_seq_length

# The released Qwen/Qwen-Image transformer/config.json (pooled_projection_dim: not an __init__ argument).
RELEASED = {"_class_name": "QwenImageTransformer2DModel", "_diffusers_version": "0.34.0.dev0", "attention_head_dim": 128,
            "axes_dims_rope": [16, 56, 56], "guidance_embeds": False, "in_channels": 64, "joint_attention_dim": 3584,
            "num_attention_heads": 24, "num_layers": 60, "out_channels": 16, "patch_size": 2,
            "pooled_projection_dim": 768}


@pytest.fixture(scope="module")
def state():
    torch.set_num_threads(1)
    return tiny.diffusers_model(tiny.tiny_config()).state_dict()


def test_config_mapping_roundtrip():
    cfg = from_diffusers(RELEASED, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert (cfg.hidden_size, cfg.kv_channels, cfg.ffn_hidden_size, cfg.num_layers) == (3072, 128, 12288, 60)
    assert (cfg.patch_dim, cfg.in_channels, cfg.joint_attention_dim) == (64, 64, 3584)
    assert cfg.qk_layernorm and cfg.layernorm_epsilon == 1e-6 and cfg.pipeline_dtype == torch.float32
    back = qwen_config.to_diffusers(cfg)
    assert {k: back[k] for k in RELEASED} == RELEASED
    tiny_back = qwen_config.to_diffusers(from_diffusers(tiny.tiny_config()))
    assert "pooled_projection_dim" not in tiny_back and tiny_back["zero_cond_t"] is False
    assert {k: tiny_back[k] for k in tiny.tiny_config()} == {**tiny.tiny_config(), "axes_dims_rope": [2, 2, 4]}


@pytest.mark.parametrize("bad, message", [
    ({"no_such_key": 1}, "no_such_key"),
    ({"axes_dims_rope": (2, 2, 2)}, r"axes_dims_rope=\(2, 2, 2\)"),
    ({"axes_dims_rope": (4, 4)}, r"axes_dims_rope=\(4, 4\)"),
    ({"zero_cond_t": True}, "zero_cond_t=True is not supported"),
    ({"guidance_embeds": True}, "guidance_embeds=True is not supported"),
])
def test_config_errors_name_the_value(bad, message):
    with pytest.raises(ValueError, match=message):
        from_diffusers({**tiny.tiny_config(), **bad})


def test_roundtrip_bit_exact_and_tables(state):
    cfg = from_diffusers(tiny.tiny_config())
    full = weight_map.to_megatron_full(state, cfg)
    back = weight_map.to_diffusers(full, cfg)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert full["layers.1.attention.linear_qkv.weight"].shape == (96, 32)
    assert torch.equal(full["context_norm.weight"], state["txt_norm.weight"])
    for name, dim in [("layers.0.attention.linear_qkv.weight", 0), ("layers.1.context_mlp.linear_fc2.weight", 1),
                      ("layers.1.attention.context_linear_proj.bias", None), ("layers.0.adaln.weight", None),
                      ("layers.0.mlp.linear_fc1.bias", 0), ("x_embed.weight", None)]:
        assert weight_map.split_dim(cfg, name) == dim, name
    streamed = weight_map.megatron_to_diffusers("layers.1.attention.context_linear_qkv.bias",
                                                full["layers.1.attention.context_linear_qkv.bias"], cfg)
    assert [n for n, _ in streamed] == [f"transformer_blocks.1.attn.add_{x}_proj.bias" for x in "qkv"]
    assert all(torch.equal(t, state[n]) for n, t in streamed)


def test_local_shards_tp_pp(state):
    dcfg = tiny.tiny_config()
    full = weight_map.to_megatron_full(state, from_diffusers(dcfg))
    cfg = from_diffusers(dcfg, pipeline_model_parallel_size=2, tensor_model_parallel_size=2)
    first = weight_map.to_megatron(state, cfg, pp_rank=0, tp_rank=1)
    last = weight_map.to_megatron(state, cfg, pp_rank=1, tp_rank=1)
    assert "context_norm.weight" in first and "final_proj.weight" not in first and "x_embed.weight" not in last
    assert torch.equal(last["layers.0.mlp.linear_fc2.weight"], full["layers.1.mlp.linear_fc2.weight"][:, 64:])
    assert torch.equal(first["layers.0.attention.linear_qkv.weight"], full["layers.0.attention.linear_qkv.weight"][48:])


@pytest.mark.parametrize("img_shape, num_text, axes", [((1, 3, 4), 7, (2, 2, 4)), ((1, 6, 5), 9, (2, 2, 4)),
                                                       ((1, 64, 40), 300, (16, 56, 56))])
def test_rope_matches_diffusers(img_shape, num_text, axes):
    """Our cos/sin tables are diffusers' QwenEmbedRope (image grid centred, text after it), and rotating q with
    them is diffusers' complex rotation."""
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope, apply_rotary_emb_qwen

    img, txt = QwenEmbedRope(theta=10000, axes_dim=list(axes), scale_rope=True)([img_shape], max_txt_seq_len=num_text)
    rope = qwen_rope(img_shape, num_text, axes, 10000)
    for (cos, sin), ref in ((rope.image, img), (rope.context, txt)):
        torch.testing.assert_close(cos, ref.real.repeat_interleave(2, dim=1), rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, ref.imag.repeat_interleave(2, dim=1), rtol=0, atol=1e-6)
        x = torch.randn(2, cos.shape[0], 3, sum(axes), generator=torch.Generator().manual_seed(0))
        want = apply_rotary_emb_qwen(x, ref, use_real=False)
        torch.testing.assert_close(apply_rope(x.transpose(0, 1), (cos, sin)).transpose(0, 1), want,
                                   rtol=0, atol=2e-5)


def test_tiny_batches_padding_is_masked_in_diffusers():
    """The parity batches exercise the mask: diffusers without it gives another velocity (the padding holds
    noise), with it the short prompt's velocity is that of the prompt alone."""
    dcfg = tiny.tiny_config()
    model = tiny.diffusers_model(dcfg, seed=3)
    b = tiny.sft_batches(dcfg, num_microbatches=1)[0]
    assert b["encoder_hidden_states_mask"].sum(1).tolist() == [5, 7]
    with torch.no_grad():
        masked = tiny.diffusers_velocity(model, b)
        unmasked = tiny.diffusers_velocity(model, {**b, "encoder_hidden_states_mask": None})
        alone = tiny.diffusers_velocity(model, {**{k: v[:1] if isinstance(v, torch.Tensor) else v for k, v in b.items()},
                                                "encoder_hidden_states": b["encoder_hidden_states"][:1, :5],
                                                "encoder_hidden_states_mask": None})
    assert float((masked[0] - unmasked[0]).abs().max()) > 1e-3
    assert float((masked[0] - alone[0]).abs().max()) <= 1e-5
    torch.testing.assert_close(masked[1], unmasked[1], rtol=0, atol=1e-6)  # the longest prompt has no padding


def test_registry_and_inputs():
    fam = registry.get_family("qwen_image")
    assert fam.diffusers_class == "QwenImageTransformer2DModel" and fam.weight_map is weight_map
    assert "qwen_image" in registry.family_names() and not fam.embedded_guidance
    mb = {k: torch.zeros(2, 12, 3) for k in ("latents", "encoder_hidden_states")}
    mb.update(sigma=torch.zeros(2), img_shapes=(1, 3, 4))
    kwargs = model_inputs(from_diffusers(tiny.tiny_config()), mb)
    assert kwargs["timestep"] is mb["sigma"] and kwargs["encoder_hidden_states_mask"] is None
    # SP at tp=2 pads 7 text tokens to 8: seq_length = 12 image + 8 text + 2 temb rows (one per rank)
    sp = from_diffusers(tiny.tiny_config(), tensor_model_parallel_size=2, sequence_parallel=True)
    assert microbatch_seq_length(sp, {"latents": torch.zeros(1, 12, 16), "encoder_hidden_states": torch.zeros(1, 7, 24)}) == 22
    assert as_img_shape([[(1, 3, 4)], [(1, 3, 4)]]) == (1, 3, 4) == as_img_shape(torch.tensor([1, 3, 4]))
    assert as_img_shape([(1, 3, 4), (1, 3, 4)]) == (1, 3, 4)
    with pytest.raises(ValueError, match="shared by the whole batch"):
        as_img_shape([[(1, 3, 4)], [(1, 4, 3)]])
