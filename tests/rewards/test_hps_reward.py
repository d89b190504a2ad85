"""``hpsv2`` on tiny random OpenCLIP-format checkpoints: the conversion to a transformers CLIPModel is checked
against the open_clip package's own CLIP on the same weights (a dev dependency: the reward never imports it), and
it and the reward's score against a plain-torch transcription of the OpenCLIP ViT / text
transformer forward written here (float64, straight from the OpenCLIP state dict: fused q/k/v, class token,
causal text mask, end-of-text pooling by argmax, 0-padded context), to 1e-5 relative (embeddings) / 1e-5 absolute
(cosines); the full ViT-H/14 shapes convert to a config with its 16 + 16 heads (meta tensors, no memory); the image
transform equals HPSv2's preprocess_val composed from torchvision (ToTensor, antialiased bicubic Resize of the
float image, CenterCrop, Normalize with the OpenAI constants written here; 1e-6); a tokenizer directory padding
with "!" (laion's) does not split "!" out; missing or wrong files are one line, before the checkpoint is read.
Needs: CPU, 1 process (~30 s: transformers)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import save_file

from megaflow.config import ConfigError, load_config
from megaflow.config.preflight import preflight
from megaflow.plan.rewards import REWARD_MODELS
from megaflow.rewards.openclip import convert_state_dict, openclip_config, openclip_pixels, openclip_to_clip
from megaflow.rewards.registry import REWARDS, build_reward

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "assets" / "shapeeval-sd3" / "tokenizer"  # a CLIP BPE tokenizer, 586 tokens, eot 585
PROMPTS = ["a red circle!", "two blue squares on grass", "a cat " * 20]  # the last one is truncated
MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)  # OpenAI CLIP


def _openclip_state(seed: int, *, v_width=64, v_layers=2, patch=8, grid=4, t_width=128, t_layers=2, vocab=586,
                    context=20, embed=24, meta=False) -> dict[str, torch.Tensor]:
    """A random state dict with OpenCLIP's names and shapes (float32; ``meta``: shapes only)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, s=0.1):
        return torch.empty(*shape, device="meta") if meta else torch.randn(*shape, generator=g) * s
    sd = {"visual.conv1.weight": rnd(v_width, 3, patch, patch), "visual.class_embedding": rnd(v_width, s=0.5),
          "visual.positional_embedding": rnd(grid * grid + 1, v_width, s=0.5), "visual.proj": rnd(v_width, embed),
          "token_embedding.weight": rnd(vocab, t_width, s=0.5), "positional_embedding": rnd(context, t_width),
          "text_projection": rnd(t_width, embed), "logit_scale": torch.tensor(math.log(100.0))}
    for ln in ("visual.ln_pre", "visual.ln_post", "ln_final"):
        width = t_width if ln == "ln_final" else v_width
        sd[f"{ln}.weight"], sd[f"{ln}.bias"] = 1 + rnd(width), rnd(width)
    for prefix, width, layers in (("visual.transformer", v_width, v_layers), ("transformer", t_width, t_layers)):
        for i in range(layers):
            b = f"{prefix}.resblocks.{i}."
            sd |= {b + "attn.in_proj_weight": rnd(3 * width, width), b + "attn.in_proj_bias": rnd(3 * width),
                   b + "attn.out_proj.weight": rnd(width, width), b + "attn.out_proj.bias": rnd(width),
                   b + "mlp.c_fc.weight": rnd(4 * width, width), b + "mlp.c_fc.bias": rnd(4 * width),
                   b + "mlp.c_proj.weight": rnd(width, 4 * width), b + "mlp.c_proj.bias": rnd(width)}
            for ln in ("ln_1", "ln_2"):
                sd[f"{b}{ln}.weight"], sd[f"{b}{ln}.bias"] = 1 + rnd(width), rnd(width)
    return sd


# --- the reference: OpenCLIP's forward written out for this test, float64, on the state dict itself ----------

def _ln(x, sd, name):
    return F.layer_norm(x, x.shape[-1:], sd[f"{name}.weight"], sd[f"{name}.bias"], eps=1e-5)


def _resblock(x, sd, b, heads, causal):
    """Pre-LN block: x + MHA(ln_1 x) (fused in_proj, q/k/v in that order), then x + c_proj(gelu(c_fc(ln_2 x)))."""
    n, length, width = x.shape
    q, k, v = F.linear(_ln(x, sd, b + "ln_1"), sd[b + "attn.in_proj_weight"], sd[b + "attn.in_proj_bias"]).chunk(3, -1)
    q, k, v = (t.reshape(n, length, heads, width // heads).transpose(1, 2) for t in (q, k, v))
    logits = q @ k.transpose(-1, -2) / math.sqrt(width // heads)
    if causal:  # token i sees tokens 0..i
        logits = logits.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    attn = (logits.softmax(-1) @ v).transpose(1, 2).reshape(n, length, width)
    x = x + F.linear(attn, sd[b + "attn.out_proj.weight"], sd[b + "attn.out_proj.bias"])
    h = F.gelu(F.linear(_ln(x, sd, b + "ln_2"), sd[b + "mlp.c_fc.weight"], sd[b + "mlp.c_fc.bias"]))
    return x + F.linear(h, sd[b + "mlp.c_proj.weight"], sd[b + "mlp.c_proj.bias"])


def _ref_image(sd, pixels, heads):
    """Patchify (conv, stride = patch), prepend the class token, add positions, ln_pre, blocks, ln_post of the
    class token, @ proj."""
    sd = {k: v.double() for k, v in sd.items()}
    patch = sd["visual.conv1.weight"].shape[-1]
    x = F.conv2d(pixels.double(), sd["visual.conv1.weight"], stride=patch).flatten(2).transpose(1, 2)
    cls = sd["visual.class_embedding"].expand(x.shape[0], 1, -1)
    x = _ln(torch.cat([cls, x], 1) + sd["visual.positional_embedding"], sd, "visual.ln_pre")
    layers = len({k.split(".")[3] for k in sd if k.startswith("visual.transformer.resblocks.")})
    for i in range(layers):
        x = _resblock(x, sd, f"visual.transformer.resblocks.{i}.", heads, causal=False)
    return _ln(x[:, 0], sd, "visual.ln_post") @ sd["visual.proj"]


def _ref_tokens(tokenizer, prompts, context):
    """OpenCLIP's tokenize: [sot] + BPE + [eot], cut to ``context`` (eot kept last), padded with 0."""
    out = torch.zeros(len(prompts), context, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids = tokenizer(prompt)["input_ids"]
        if len(ids) > context:
            ids = ids[:context - 1] + [tokenizer.eos_token_id]
        out[row, :len(ids)] = torch.tensor(ids)
    return out


def _ref_text(sd, ids, heads):
    """Embed + positions, causal blocks, ln_final, the features at the end-of-text token (the largest id) @
    text_projection."""
    sd = {k: v.double() for k, v in sd.items()}
    x = sd["token_embedding.weight"][ids] + sd["positional_embedding"][:ids.shape[1]]
    layers = len({k.split(".")[2] for k in sd if k.startswith("transformer.resblocks.")})
    for i in range(layers):
        x = _resblock(x, sd, f"transformer.resblocks.{i}.", heads, causal=True)
    x = _ln(x, sd, "ln_final")
    return x[torch.arange(len(ids)), ids.argmax(-1)] @ sd["text_projection"]


def _rel(actual: torch.Tensor, reference: torch.Tensor) -> float:
    return float((actual.double() - reference).abs().max() / reference.abs().max())


def _features(out):
    return out if isinstance(out, torch.Tensor) else out.pooler_output


# --- tests ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("heads", [None, (4, 8)])
def test_conversion_matches_the_openclip_forward(heads):
    """Default heads (64-wide: 1 image, 2 text) and explicit ones; embeddings to 1e-5 relative."""
    sd = _openclip_state(0)
    kwargs = {} if heads is None else {"vision_heads": heads[0], "text_heads": heads[1]}
    model = openclip_to_clip(sd, **kwargs)
    v_heads, t_heads = heads or (1, 2)
    assert model.config.vision_config.num_attention_heads == v_heads
    assert model.config.text_config.num_attention_heads == t_heads
    assert model.config.vision_config.image_size == 32 and model.config.text_config.max_position_embeddings == 20
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[584, 320, 66, 585, 0, 0], [584, 516, 533, 565, 12, 585], [584, 585, 0, 0, 0, 0]])
    with torch.no_grad():
        image = _features(model.get_image_features(pixel_values=pixels))
        text = _features(model.get_text_features(input_ids=ids, attention_mask=(ids > 0).long()))
    ref_image, ref_text = _ref_image(sd, pixels, v_heads), _ref_text(sd, ids, t_heads)
    assert _rel(image, ref_image) < 1e-5, _rel(image, ref_image)
    assert _rel(text, ref_text) < 1e-5, _rel(text, ref_text)
    assert float(model.logit_scale.exp()) == pytest.approx(100.0, rel=1e-6)
    wrong = openclip_to_clip(sd, vision_heads=4 if heads is None else 1)  # the heads matter
    with torch.no_grad():
        assert _rel(_features(wrong.get_image_features(pixel_values=pixels)), ref_image) > 1e-3


def test_conversion_matches_the_open_clip_package():
    """The same random weights loaded (strictly: every name and shape) into open_clip's own CLIP model, the one HPSv2
    scores with: megaflow's converted CLIPModel gives its image and text embeddings to 1e-5 relative."""
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg
    sd = _openclip_state(0)
    reference = CLIP(embed_dim=24, vision_cfg=CLIPVisionCfg(layers=2, width=64, head_width=64, patch_size=8,
                                                            image_size=32),
                     text_cfg=CLIPTextCfg(context_length=20, vocab_size=586, width=128, heads=2, layers=2))
    reference.load_state_dict(sd, strict=True)
    reference.eval()
    model = openclip_to_clip(sd)
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    ids = torch.zeros(3, 20, dtype=torch.long)  # open_clip's layout: [sot] ... [eot], 0-padded to the context
    for row, seq in enumerate([[584, 320, 66, 585], [584, 516, 533, 565, 12, 585], [584, 585]]):
        ids[row, :len(seq)] = torch.tensor(seq)
    with torch.no_grad():
        want_image, want_text = reference.encode_image(pixels), reference.encode_text(ids)
        image = _features(model.get_image_features(pixel_values=pixels))
        text = _features(model.get_text_features(input_ids=ids, attention_mask=(ids > 0).long()))
    assert _rel(image, want_image.double()) < 1e-5, _rel(image, want_image.double())
    assert _rel(text, want_text.double()) < 1e-5, _rel(text, want_text.double())


def test_vit_h_shapes_give_the_hps_config():
    """HPSv2.1's architecture (OpenCLIP ViT-H-14: image 1280 wide, 32 layers, 80-wide heads; text 1024 wide, 24
    layers, 64-wide heads), converted on the meta device: every CLIPModel tensor present with its shape."""
    from transformers import CLIPModel
    sd = _openclip_state(0, v_width=1280, v_layers=32, patch=14, grid=16, t_width=1024, t_layers=24, vocab=49408,
                         context=77, embed=1024, meta=True)
    config = openclip_config(sd)
    v, t = config.vision_config, config.text_config
    assert (v.hidden_size, v.num_hidden_layers, v.num_attention_heads, v.patch_size, v.image_size,
            v.intermediate_size, v.hidden_act) == (1280, 32, 16, 14, 224, 5120, "gelu")
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.vocab_size, t.max_position_embeddings,
            t.intermediate_size, t.eos_token_id, t.hidden_act) == (1024, 24, 16, 49408, 77, 4096, 49407, "gelu")
    assert config.projection_dim == 1024
    with torch.device("meta"):
        want = {k: tuple(p.shape) for k, p in CLIPModel(config).state_dict().items() if not k.endswith("position_ids")}
    got = {k: tuple(p.shape) for k, p in convert_state_dict(sd, 32, 24).items()}
    assert got == want
    assert sum(math.prod(shape) for shape in got.values()) == REWARD_MODELS["hpsv2"].params  # megaflow plan's row


def _torchvision_reference(image: Image.Image, size: int) -> torch.Tensor:
    """HPSv2's preprocess_val (hpsv2 1.1 / 1.2: OpenCLIP's inference transform with ToTensor moved first, so the
    float tensor is resized, antialiased as torchvision >= 0.17 does by default)."""
    from torchvision import transforms as T
    return T.Compose([T.ToTensor(), T.Resize(size, interpolation=T.InterpolationMode.BICUBIC, antialias=True),
                      T.CenterCrop(size), T.Normalize(MEAN, STD)])(image)


@pytest.mark.parametrize("shape", [(40, 48), (48, 40), (32, 35), (20, 26), (32, 32), (224, 300)])
def test_image_transform_matches_torchvision(shape):
    """Down- and upscaling, portrait / landscape, an odd crop offset (32 x 35: round(1.5) = 2), no resize."""
    rng = np.random.default_rng(sum(shape))
    array = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
    size = 224 if shape == (224, 300) else 32
    ours = openclip_pixels([array], size)[0]
    torch.testing.assert_close(ours, _torchvision_reference(Image.fromarray(array), size), atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def hps_files(tmp_path_factory) -> dict[str, Path]:
    """The tiny checkpoint as HPS ships it (``{"state_dict": ...}`` in a .pt) and as .safetensors."""
    root = tmp_path_factory.mktemp("hps")
    sd = _openclip_state(3)
    torch.save({"state_dict": sd, "epoch": 1}, root / "hps.pt")
    torch.save({f"module.{k}": v for k, v in sd.items()}, root / "ddp.pth")  # saved from a DDP wrapper
    save_file({k: v.contiguous() for k, v in sd.items()}, root / "hps.safetensors")
    from transformers import CLIPTokenizer
    CLIPTokenizer.from_pretrained(TOKENIZER, pad_token="!").save_pretrained(root / "tok")  # "!" special, as laion's
    return {"pt": root / "hps.pt", "ddp": root / "ddp.pth", "safetensors": root / "hps.safetensors",
            "tok": root / "tok"}


@pytest.mark.parametrize("kind", ["pt", "ddp", "safetensors"])
def test_hpsv2_scores_the_openclip_cosine(hps_files, kind):
    """The reward = cos(reference image embedding of torchvision-transformed 8-bit images, reference text embedding
    of OpenCLIP-tokenised prompts), 1e-5 absolute; 2 batches (batch_size 2), one prompt truncated, one with a "!"
    that a tokenizer directory padding with "!" (laion's) must not split out as a special token."""
    from transformers import CLIPTokenizer
    ref_ids = CLIPTokenizer.from_pretrained(TOKENIZER)(PROMPTS[0])["input_ids"]
    assert CLIPTokenizer.from_pretrained(hps_files["tok"])(PROMPTS[0])["input_ids"] != ref_ids  # loaded as is
    images = torch.rand(3, 3, 40, 52, generator=torch.Generator().manual_seed(4))
    reward = build_reward("hpsv2", path=str(hps_files[kind]), tokenizer_path=str(hps_files["tok"]), batch_size=2)
    assert reward.clip.tokenizer(PROMPTS[0])["input_ids"] == ref_ids
    scores = reward(images, PROMPTS)
    sd = _openclip_state(3)
    arrays = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    pixels = torch.stack([_torchvision_reference(Image.fromarray(a), 32) for a in arrays])
    ids = _ref_tokens(CLIPTokenizer.from_pretrained(TOKENIZER), PROMPTS, 20)
    ref = F.cosine_similarity(_ref_image(sd, pixels, 1), _ref_text(sd, ids, 2), dim=-1)
    assert scores.shape == (3,) and scores.dtype == torch.float32
    assert ref.abs().min() > 1e-3 and ref.max() - ref.min() > 1e-3  # a real similarity, not a constant
    torch.testing.assert_close(scores.double(), ref, atol=1e-5, rtol=0)


def _one_line_error(**kwargs) -> str:
    with pytest.raises(ValueError) as e:
        build_reward("hpsv2", **kwargs)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def test_bad_files_are_one_line_before_the_checkpoint_is_read(hps_files, tmp_path, monkeypatch):
    assert "hpsv2" in REWARDS
    tok = str(TOKENIZER)
    monkeypatch.setattr("megaflow.rewards.hps.load_openclip", lambda *a, **k: pytest.fail("checkpoint read"))
    msg = _one_line_error(tokenizer_path=tok)
    assert msg.startswith("reward.kwargs.hpsv2.path: ") and "hf download xswu/HPSv2 HPS_v2.1_compressed.pt" in msg
    assert "no such file" in _one_line_error(path=str(tmp_path / "HPS_v2.1_compressed.pt"), tokenizer_path=tok)
    assert "is a directory" in _one_line_error(path=str(tmp_path), tokenizer_path=tok)
    msg = _one_line_error(path=str(hps_files["pt"]))
    assert msg.startswith("reward.kwargs.hpsv2.tokenizer_path: ") and "laion/CLIP-ViT-H-14-laion2B-s32B-b79K" in msg
    assert "no tokenizer.json" in _one_line_error(path=str(hps_files["pt"]), tokenizer_path=str(tmp_path))
    (tmp_path / "cut.safetensors").write_bytes(b"\x08")
    assert "truncated" in _one_line_error(path=str(tmp_path / "cut.safetensors"), tokenizer_path=tok)


def test_wrong_checkpoints_are_one_line(tmp_path):
    tok = str(TOKENIZER)
    torch.save([1, 2, 3], tmp_path / "list.pt")
    assert "expected a state dict" in _one_line_error(path=str(tmp_path / "list.pt"), tokenizer_path=tok)
    (tmp_path / "junk.pt").write_bytes(b"not a pickle")
    assert "not a torch state dict" in _one_line_error(path=str(tmp_path / "junk.pt"), tokenizer_path=tok)
    torch.save({"fc.weight": torch.zeros(2, 2)}, tmp_path / "other.pt")
    assert "not an OpenCLIP ViT checkpoint" in _one_line_error(path=str(tmp_path / "other.pt"), tokenizer_path=tok)
    sd = _openclip_state(5)
    torch.save(sd | {"visual.transformer.resblocks.0.ls_1.gamma": torch.ones(64)}, tmp_path / "scaled.pt")
    assert "unsupported layout" in _one_line_error(path=str(tmp_path / "scaled.pt"), tokenizer_path=tok)
    torch.save(_openclip_state(5, vocab=600), tmp_path / "vocab.pt")
    assert "does not fit" in _one_line_error(path=str(tmp_path / "vocab.pt"), tokenizer_path=tok)


def _config(tmp_path: Path, kwargs: dict):
    lines = ["[reward]", "weights = {hpsv2 = 1.0}", "[reward.kwargs.hpsv2]",
             *(f"{k} = {json.dumps(v)}" for k, v in kwargs.items())]
    (tmp_path / "run.toml").write_text("\n".join(lines) + "\n")
    return load_config(tmp_path / "run.toml")


def test_preflight_checks_the_hps_files(hps_files, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    good = _config(tmp_path, {"path": str(hps_files["pt"]), "tokenizer_path": str(TOKENIZER)})
    assert preflight(good, "train") is good
    no_path = _config(tmp_path, {"tokenizer_path": str(TOKENIZER)})
    with pytest.raises(ConfigError, match=r"^reward\.kwargs\.hpsv2\.path: the hpsv2 reward needs its checkpoint "
                                          r"file \(hf download xswu/HPSv2 HPS_v2\.1_compressed\.pt"):
        preflight(no_path, "train")
    no_tok = _config(tmp_path, {"path": str(hps_files["pt"])})
    with pytest.raises(ConfigError, match=r"^reward\.kwargs\.hpsv2\.tokenizer_path: .*hf download laion/"):
        preflight(no_tok, "train")
