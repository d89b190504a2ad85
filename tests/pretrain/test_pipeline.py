"""The ShapeEval pipeline: assembled and saved so diffusers loads it, conditioning as SGLang computes it,
and the pretraining pieces (EMA, sampler) on tiny sizes. Needs: CPU, 1 process."""
import json

import torch

from megaflow.models.sd3 import shapes as kit
from megaflow.models.sd3.shapes import (SPATIAL_FACTOR, TEXT_LEN, assemble, decode, make_vae, text_components,
                                        transformer_config)
from megaflow.pretrain.kit import save_pipeline
from megaflow.pretrain.loop import EMA

PROMPTS = ["two red circles left of a blue square", "a cyan triangle", ""]


def _pipe():
    text = text_components(seed=0)
    kit.finish_text(text)
    tcfg = transformer_config(resolution=32, num_layers=1, num_heads=2, head_dim=16)
    return assemble(text=text, vae=make_vae(seed=1), transformer_config=tcfg, transformer_state=None)


def test_conditioning_matches_diffusers_where_both_define_it():
    """SGLang pads CLIP to the request length L (diffusers: 77). CLIP is causal, so the first L CLIP
    positions and the pooled output are the same either way; the T5 part equals diffusers' with
    max_sequence_length=L (tolerance: fp32 noise, 1e-6)."""
    pipe = _pipe()
    cond = kit.conditioning(pipe, PROMPTS)
    ours, pooled = cond["encoder_hidden_states"], cond["pooled_projections"]
    ref, _, ref_pooled, _ = pipe.encode_prompt(prompt=PROMPTS, prompt_2=None, prompt_3=None,
                                               do_classifier_free_guidance=False, max_sequence_length=TEXT_LEN)
    assert ours.shape == (3, 2 * TEXT_LEN, 64) and ref.shape == (3, 77 + TEXT_LEN, 64)
    torch.testing.assert_close(ours[:, :TEXT_LEN], ref[:, :TEXT_LEN], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours[:, TEXT_LEN:], ref[:, 77:], atol=1e-6, rtol=0)
    torch.testing.assert_close(pooled, ref_pooled, atol=1e-6, rtol=0)


def test_saved_pipeline_loads_in_diffusers_and_declares_its_text_length(tmp_path):
    from diffusers import StableDiffusion3Pipeline
    pipe = _pipe()
    out = save_pipeline(kit, pipe, tmp_path / "p", extra_files={"megaflow.json": json.dumps({"max_sequence_length": TEXT_LEN})})
    assert json.loads((out / "vae" / "config.json").read_text())["spatial_compression_ratio"] == SPATIAL_FACTOR
    loaded = StableDiffusion3Pipeline.from_pretrained(out)
    assert loaded.vae_scale_factor == SPATIAL_FACTOR
    for (n, a), (_, b) in zip(pipe.transformer.state_dict().items(), loaded.transformer.state_dict().items()):
        assert torch.equal(a, b), n
    img = decode(loaded.vae, torch.zeros(1, 4, 16, 16))
    assert img.shape == (1, 3, 32, 32)
    save_pipeline(kit, pipe, out)  # replacing an existing pipeline leaves no temp dirs behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]


def test_ema_tracks_and_swaps():
    p = torch.nn.Parameter(torch.zeros(3))
    ema = EMA([p], decay=0.5)
    with torch.no_grad():
        p.fill_(1.0)
    ema.update(step=1000)  # decay min(0.5, ~1) = 0.5
    torch.testing.assert_close(ema.shadow[0], torch.full((3,), 0.5))
    ema.swap()
    torch.testing.assert_close(p.detach(), torch.full((3,), 0.5))
    ema.swap()
    torch.testing.assert_close(p.detach(), torch.ones(3))
