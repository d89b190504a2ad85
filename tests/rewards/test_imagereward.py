"""``imagereward`` on a tiny random ImageReward download written here (a state dict under BLIP's names +
med_config.json, a WordPiece vocab): the reward's score equals a plain-torch transcription of BLIP's ViT,
cross-attention BERT and MLP head run on that state dict (rtol 1e-5); its image preprocessing equals
torchvision's Resize(shorter side, bicubic) / CenterCrop / ToTensor / Normalize (atol 1e-6); its tokens equal ids
worked out by hand (35 tokens, padded, truncated); its score equals the image-reward package's own
ImageReward.score on the same weights (1e-5); missing files are one line from the reward and from
preflight, before anything is loaded. Needs: CPU, 1 process (~15 s: transformers)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from megaflow.config import ConfigError, load_config
from megaflow.config.preflight import REWARD_NAMES, preflight
from megaflow.rewards.registry import REWARDS, build_reward

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "red", "circle", "two", "blue", "square", "on", "grass",
         "cat", "dog", "##s", "photo", "of", "the"]
ID = {w: i for i, w in enumerate(VOCAB)}
PROMPTS = ["a red circle", "Two blue squares on grass", "a photo of the cat"]
VIT = dict(width=128, depth=2, mlp=256, patch=16, grid=4)  # 64 px, 2 heads of 64
BERT = dict(width=32, heads=2, depth=2, ffn=64, positions=40, eps=1e-12)
SHIFT, SCALE = 0.16717362830052426, 1.0333394966054072  # the release's normalisation, restated


def _random_lavis_state(seed: int) -> dict[str, torch.Tensor]:
    """A tiny ImageReward.pt state dict: BLIP's names, random weights of a useful scale, plus unused keys."""
    g = torch.Generator().manual_seed(seed)

    def lin(name: str, out_dim: int, in_dim: int) -> dict[str, torch.Tensor]:
        return {f"{name}.weight": torch.randn(out_dim, in_dim, generator=g) / math.sqrt(in_dim),
                f"{name}.bias": 0.1 * torch.randn(out_dim, generator=g)}

    def norm(name: str, dim: int) -> dict[str, torch.Tensor]:
        return {f"{name}.weight": 1 + 0.1 * torch.randn(dim, generator=g),
                f"{name}.bias": 0.1 * torch.randn(dim, generator=g)}

    v, w, p = "blip.visual_encoder.", VIT["width"], VIT["patch"]
    sd = {f"{v}cls_token": torch.randn(1, 1, w, generator=g),
          f"{v}pos_embed": torch.randn(1, VIT["grid"] ** 2 + 1, w, generator=g),
          f"{v}patch_embed.proj.weight": torch.randn(w, 3, p, p, generator=g) / math.sqrt(3 * p * p),
          f"{v}patch_embed.proj.bias": 0.1 * torch.randn(w, generator=g), **norm(f"{v}norm", w)}
    for i in range(VIT["depth"]):
        b = f"{v}blocks.{i}."
        sd |= norm(b + "norm1", w) | lin(b + "attn.qkv", 3 * w, w) | lin(b + "attn.proj", w, w)
        sd |= norm(b + "norm2", w) | lin(b + "mlp.fc1", VIT["mlp"], w) | lin(b + "mlp.fc2", w, VIT["mlp"])
    t, d = "blip.text_encoder.", BERT["width"]
    sd |= {f"{t}embeddings.word_embeddings.weight": torch.randn(len(VOCAB) + 2, d, generator=g),  # + BLIP's [DEC] [ENC]
           f"{t}embeddings.position_embeddings.weight": torch.randn(BERT["positions"], d, generator=g),
           f"{t}embeddings.position_ids": torch.arange(BERT["positions"])[None]}
    sd |= norm(f"{t}embeddings.LayerNorm", d)
    for i in range(BERT["depth"]):
        b = f"{t}encoder.layer.{i}."
        for a, kv in (("attention.", d), ("crossattention.", w)):
            sd |= lin(b + a + "self.query", d, d) | lin(b + a + "self.key", d, kv) | lin(b + a + "self.value", d, kv)
            sd |= lin(b + a + "output.dense", d, d) | norm(b + a + "output.LayerNorm", d)
        sd |= lin(b + "intermediate.dense", BERT["ffn"], d) | lin(b + "output.dense", d, BERT["ffn"])
        sd |= norm(b + "output.LayerNorm", d)
    for i, (o, n) in zip((0, 2, 4, 6, 7), ((1024, d), (128, 1024), (64, 128), (16, 64), (1, 16))):
        sd |= lin(f"mlp.layers.{i}", o, n)
    return sd | lin("blip.vision_proj", 8, w) | lin("blip.text_proj", 8, d)  # in the release, unused by the score


def _write_tokenizer(root: Path) -> Path:
    root.mkdir()
    (root / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    (root / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True, "tokenizer_class": "BertTokenizer"}))
    return root


@pytest.fixture(scope="module")
def download(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("imagereward")
    (root / "model").mkdir()
    state = _random_lavis_state(0)
    torch.save(state, root / "model" / "ImageReward.pt")
    med = {"architectures": ["BertModel"], "hidden_act": "gelu", "hidden_size": BERT["width"],
           "num_attention_heads": BERT["heads"], "layer_norm_eps": BERT["eps"], "add_cross_attention": True,
           "encoder_width": VIT["width"], "pad_token_id": 0, "vocab_size": len(VOCAB) + 2}
    (root / "model" / "med_config.json").write_text(json.dumps(med))
    return {"model": root / "model", "tokenizer": _write_tokenizer(root / "tokenizer"), "state": state}


# --- a plain-torch transcription of the published forward, on the BLIP-named state dict -----------------------

def _ln(sd, key, x, eps):
    return F.layer_norm(x, x.shape[-1:], sd[f"{key}.weight"], sd[f"{key}.bias"], eps)


def _lin(sd, key, x):
    return x @ sd[f"{key}.weight"].T + sd[f"{key}.bias"]


def _attend(q, k, v, heads, key_mask=None):
    """Softmax(q k^T / sqrt(d)) v per head; ``key_mask`` [B, S] (True = attend) hides padding keys."""
    (b, t, dim), s = q.shape, k.shape[1]
    q, k, v = (x.reshape(b, -1, heads, dim // heads).transpose(1, 2) for x in (q, k, v))
    logits = q @ k.transpose(-1, -2) / math.sqrt(dim // heads)
    if key_mask is not None:
        logits = logits.masked_fill(~key_mask.view(b, 1, 1, s), float("-inf"))
    return (logits.softmax(-1) @ v).transpose(1, 2).reshape(b, t, dim)


def _reference_vit(sd, pixels):
    v = "blip.visual_encoder."
    x = F.conv2d(pixels, sd[f"{v}patch_embed.proj.weight"], sd[f"{v}patch_embed.proj.bias"], stride=VIT["patch"])
    x = torch.cat([sd[f"{v}cls_token"].expand(len(x), 1, -1), x.flatten(2).transpose(1, 2)], 1) + sd[f"{v}pos_embed"]
    for i in range(VIT["depth"]):
        b = f"{v}blocks.{i}."
        q, k, val = _lin(sd, b + "attn.qkv", _ln(sd, b + "norm1", x, 1e-6)).chunk(3, dim=-1)
        x = x + _lin(sd, b + "attn.proj", _attend(q, k, val, VIT["width"] // 64))
        x = x + _lin(sd, b + "mlp.fc2", F.gelu(_lin(sd, b + "mlp.fc1", _ln(sd, b + "norm2", x, 1e-6))))
    return _ln(sd, f"{v}norm", x, 1e-6)


def _reference_text(sd, ids, mask, image):
    t, eps, h = "blip.text_encoder.", BERT["eps"], BERT["heads"]
    x = sd[f"{t}embeddings.word_embeddings.weight"][ids]
    x = x + sd[f"{t}embeddings.position_embeddings.weight"][:ids.shape[1]]
    x = _ln(sd, f"{t}embeddings.LayerNorm", x, eps)
    for i in range(BERT["depth"]):
        b = f"{t}encoder.layer.{i}."
        for a, key_mask in (("attention.", mask.bool()), ("crossattention.", None)):  # self: padding hidden
            src = x if a == "attention." else image
            ctx = _attend(_lin(sd, b + a + "self.query", x), _lin(sd, b + a + "self.key", src),
                          _lin(sd, b + a + "self.value", src), h, key_mask)
            x = _ln(sd, b + a + "output.LayerNorm", _lin(sd, b + a + "output.dense", ctx) + x, eps)
        ffn = _lin(sd, b + "output.dense", F.gelu(_lin(sd, b + "intermediate.dense", x)))
        x = _ln(sd, b + "output.LayerNorm", ffn + x, eps)
    return x


def _reference_score(sd, pixels, ids, mask):
    features = _reference_text(sd, ids, mask, _reference_vit(sd, pixels))[:, 0]
    for i in (0, 2, 4, 6, 7):  # dropouts are identities at inference, no activations
        features = _lin(sd, f"mlp.layers.{i}", features)
    return ((features - SHIFT) / SCALE).squeeze(-1)


def _reference_pixels(pil: list[Image.Image], size: int) -> torch.Tensor:
    from torchvision import transforms as T
    ops = T.Compose([T.Resize(size, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(size), T.ToTensor(),
                     T.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))])
    return torch.stack([ops(im.convert("RGB")) for im in pil])


def _images() -> list[Image.Image]:
    """Portrait, landscape and exactly-sized images (the reward accepts a list of PIL images of any sizes)."""
    g = torch.Generator().manual_seed(1)
    return [Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy())
            for h, w in ((90, 50), (60, 100), (64, 64))]


def test_score_matches_a_plain_torch_transcription(download):
    from transformers import BertTokenizer

    reward = build_reward("imagereward", path=str(download["model"]), tokenizer_path=str(download["tokenizer"]),
                          batch_size=2)  # 2 batches
    images = _images()
    scores = reward(images, PROMPTS)
    tokens = BertTokenizer.from_pretrained(download["tokenizer"])(PROMPTS, padding="max_length", truncation=True,
                                                                  max_length=35, return_tensors="pt")
    with torch.no_grad():
        expected = _reference_score(download["state"], _reference_pixels(images, 64), tokens["input_ids"],
                                    tokens["attention_mask"])
    assert scores.shape == (3,) and scores.dtype == torch.float32
    assert expected.max() - expected.min() > 0.1, expected  # the weights move the score, not only the offset
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-6)
    swapped = reward([images[0], images[0], images[1]], [PROMPTS[0], PROMPTS[1], PROMPTS[0]])
    assert abs(swapped[0] - swapped[1]) > 1e-3 and abs(swapped[0] - swapped[2]) > 1e-3  # prompt and image both count


def _imagereward_package():
    """The image-reward package's own modules (ImageReward 1.5, installed without its dependencies' pins), imported
    past what no longer exists in this stack: its packages' __init__ (they import OpenAI's clip, not installed) are
    not run, and transformers 5 helpers its BERT calls (removed upstream) are put back with their old meaning --
    fairscale's checkpoint wrapper (only for gradient checkpointing) as the identity, init_weights
    (its random init: the weights are loaded after) as nothing, get_head_mask as "no head mask",
    invert_attention_mask as BERT's additive mask, find_pruneable_heads_and_indices (pruning only) absent."""
    import importlib
    import importlib.util
    import sys
    import types

    import transformers.modeling_utils as mu
    import transformers.pytorch_utils as pu
    for name in ("apply_chunking_to_forward", "prune_linear_layer"):
        setattr(mu, name, getattr(pu, name))
    mu.find_pruneable_heads_and_indices = None
    fairscale = {n: types.ModuleType(n) for n in ("fairscale", "fairscale.nn", "fairscale.nn.checkpoint",
                                                  "fairscale.nn.checkpoint.checkpoint_activations")}
    fairscale["fairscale.nn.checkpoint.checkpoint_activations"].checkpoint_wrapper = lambda module, **_: module
    root = Path(importlib.util.find_spec("ImageReward").origin).parent
    packages = {}  # the package and its subpackages, their __init__ (which imports everything) not run
    for name, folder in (("ImageReward", root), ("ImageReward.models", root / "models"),
                         ("ImageReward.models.BLIP", root / "models" / "BLIP")):
        packages[name] = types.ModuleType(name)
        packages[name].__path__ = [str(folder)]
    saved = {k: sys.modules.get(k) for k in [*fairscale, *packages]}
    sys.modules.update(fairscale)
    sys.modules.update(packages)
    try:
        med = importlib.import_module("ImageReward.models.BLIP.med")
        vit = importlib.import_module("ImageReward.models.BLIP.vit")
        release = importlib.import_module("ImageReward.ImageReward")
    finally:
        for k, v in saved.items():
            sys.modules.pop(k) if v is None else sys.modules.__setitem__(k, v)

    def invert_attention_mask(self, mask):
        return (1.0 - mask[:, None, None, :].to(torch.float32)) * torch.finfo(torch.float32).min

    med.BertModel.init_weights = lambda self: None  # its random init: the weights are loaded over it
    med.BertModel.get_head_mask = lambda self, head_mask, layers: [None] * layers
    med.BertModel.invert_attention_mask = invert_attention_mask
    return med, vit, release


def test_score_matches_the_imagereward_package(download):
    """The release's own ImageReward.score (its ViT, its cross-attention BERT, its MLP head and its preprocess, at
    this test's 64 px instead of 224) on the same random weights: megaflow's scores to 1e-5 relative."""
    import functools

    from torch import nn
    from transformers import BertTokenizer
    med, vit, release = _imagereward_package()
    state, width = download["state"], BERT["width"]
    part = lambda prefix: {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}  # noqa: E731
    visual = vit.VisionTransformer(img_size=64, patch_size=VIT["patch"], embed_dim=VIT["width"], depth=VIT["depth"],
                                   num_heads=VIT["width"] // 64, mlp_ratio=VIT["mlp"] / VIT["width"],
                                   norm_layer=functools.partial(nn.LayerNorm, eps=1e-6))
    visual.load_state_dict(part("blip.visual_encoder."), strict=True)
    config = med.BertConfig.from_json_file(str(download["model"] / "med_config.json"))
    config.intermediate_size, config.num_hidden_layers = BERT["ffn"], BERT["depth"]
    config.max_position_embeddings = BERT["positions"]
    text = med.BertModel(config=config, add_pooling_layer=False)
    text.load_state_dict(part("blip.text_encoder."), strict=True)
    head = release.MLP(width)
    head.load_state_dict(part("mlp."), strict=True)
    scorer = release.ImageReward.__new__(release.ImageReward)  # its __init__ builds a ViT-L at 224: set by hand
    nn.Module.__init__(scorer)
    scorer.device, scorer.mean, scorer.std, scorer.mlp = "cpu", SHIFT, SCALE, head
    scorer.blip = nn.Module()
    scorer.blip.visual_encoder, scorer.blip.text_encoder = visual, text
    scorer.blip.tokenizer = BertTokenizer.from_pretrained(download["tokenizer"])
    scorer.preprocess = release._transform(64)
    scorer.eval()
    images = _images()
    with torch.no_grad():
        want = torch.tensor([scorer.score(p, im) for p, im in zip(PROMPTS, images)], dtype=torch.float32)
    got = build_reward("imagereward", path=str(download["model"]), tokenizer_path=str(download["tokenizer"]))(
        images, PROMPTS)
    assert want.max() - want.min() > 0.1, want
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_preprocessing_matches_the_published_transform():
    from megaflow.rewards.imagereward import preprocess

    pil = [*_images(), Image.new("RGB", (500, 333), (200, 30, 90)), Image.new("RGB", (224, 224), (1, 2, 3))]
    for im in pil:
        torch.testing.assert_close(preprocess([im], 224), _reference_pixels([im], 224), atol=1e-6, rtol=0)
    x = torch.rand(2, 3, 300, 200, generator=torch.Generator().manual_seed(2))  # the loop's float tensors
    as_pil = [Image.fromarray(a) for a in (x * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()]
    out = preprocess(x, 224)
    assert out.shape == (2, 3, 224, 224)
    torch.testing.assert_close(out, _reference_pixels(as_pil, 224), atol=1e-6, rtol=0)


def test_tokens_are_padded_to_and_truncated_at_35(download):
    from megaflow.rewards.imagereward import MAX_TOKENS, load_tokenizer, tokenize

    assert MAX_TOKENS == 35
    long = " ".join(["red", "circle"] * 30)  # 60 words
    out = tokenize(load_tokenizer(str(download["tokenizer"])), ["A Red circle", "two dogs on zebras", long])
    pad = lambda ids: ids + [ID["[PAD]"]] * (35 - len(ids))  # noqa: E731
    expected = [pad([ID[w] for w in ("[CLS]", "a", "red", "circle", "[SEP]")]),
                pad([ID[w] for w in ("[CLS]", "two", "dog", "##s", "on", "[UNK]", "[SEP]")]),
                [ID["[CLS]"]] + [ID["red"], ID["circle"]] * 16 + [ID["red"], ID["[SEP]"]]]
    assert out["input_ids"].tolist() == expected
    assert out["attention_mask"].sum(1).tolist() == [5, 7, 35]
    assert out["attention_mask"][0, :5].all() and not out["attention_mask"][0, 5:].any()


def _one_line_error(**kwargs) -> str:
    with pytest.raises(ValueError) as e:
        build_reward("imagereward", **kwargs)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def test_registered_and_missing_files_are_one_line_before_loading(download, tmp_path, monkeypatch):
    assert "imagereward" in REWARDS and "imagereward" in REWARD_NAMES
    tok, model = str(download["tokenizer"]), str(download["model"])
    msg = _one_line_error(path=str(tmp_path / "nope"), tokenizer_path=tok)
    assert msg.startswith("reward.kwargs.imagereward.path: ") and "is not a directory" in msg
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "ImageReward.pt").write_bytes(b"garbage")  # unreadable: must not be read before the checks
    msg = _one_line_error(path=str(tmp_path / "half"), tokenizer_path=tok)
    assert "has no med_config.json" in msg and "hf download THUDM/ImageReward --local-dir DIR" in msg
    (tmp_path / "half" / "med_config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    msg = _one_line_error(path=str(tmp_path / "half"), tokenizer_path=str(tmp_path / "empty"))
    assert msg.startswith("reward.kwargs.imagereward.tokenizer_path: ") and "has no vocab.txt or tokenizer.json" in msg
    assert "hf download google-bert/bert-base-uncased" in msg
    msg = _one_line_error(path=str(tmp_path / "half"), tokenizer_path=tok)  # the files are there: now it is read
    assert "imagereward checkpoint" in msg and "not a torch state dict" in msg
    state = {k: v for k, v in download["state"].items() if not k.startswith("blip.text_encoder.")}
    (tmp_path / "notext").mkdir()
    torch.save(state, tmp_path / "notext" / "ImageReward.pt")
    (tmp_path / "notext" / "med_config.json").write_text("{}")
    assert "no blip.text_encoder.* tensors" in _one_line_error(path=str(tmp_path / "notext"), tokenizer_path=tok)
    assert "batch_size must be" in _one_line_error(path=model, tokenizer_path=tok, batch_size=0)

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = tmp_path / "run.toml"
    run.write_text(f'[reward]\nweights = {{imagereward = 1.0}}\n[reward.kwargs.imagereward]\npath = "{model}"\n')
    with pytest.raises(ConfigError, match=r"^reward\.kwargs\.imagereward\.tokenizer_path: .*bert-base-uncased"):
        preflight(load_config(run), "train")
    run.write_text(run.read_text() + f'tokenizer_path = "{tok}"\n')
    cfg = load_config(run)
    assert preflight(cfg, "train") is cfg
