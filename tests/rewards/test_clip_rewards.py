"""``clipscore``, ``pickscore`` and ``aesthetic`` on a tiny random CLIP saved to a temporary directory (the
repo's tiny CLIP tokenizer, a 32 x 32 image processor): each score equals an independent computation written
here with plain torch and the model's get_image_features / get_text_features (1e-5); missing or malformed
files are one line (from the reward and from preflight); a config naming the rewards passes preflight and is
scored by the loop's scorer (megaflow.run.build.build_scorer). Needs: CPU, 1 process (~20 s: transformers)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from torch import nn
from transformers import AutoTokenizer, CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

from megaflow.config import ConfigError, load_config
from megaflow.config.preflight import preflight
from megaflow.rewards.registry import build_reward

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["a red circle", "two blue squares on grass", "a cat"]


def _tiny_clip(seed: int) -> tuple[CLIPModel, CLIPProcessor]:
    tok = AutoTokenizer.from_pretrained(REPO / "assets" / "shapeeval-sd3" / "tokenizer")
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=77, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8)
    torch.manual_seed(seed)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).eval()
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return model, CLIPProcessor(image_processor=images, tokenizer=tok)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """``clip``: model + processor in one directory; ``pick``: model only, ``pick_proc``: its processor."""
    root = tmp_path_factory.mktemp("clip")
    model, processor = _tiny_clip(0)
    model.save_pretrained(root / "clip")
    processor.save_pretrained(root / "clip")
    pick, _ = _tiny_clip(1)
    pick.save_pretrained(root / "pick")
    processor.save_pretrained(root / "pick_proc")
    return {name: root / name for name in ("clip", "pick", "pick_proc")}


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.rand(3, 3, 40, 48, generator=torch.Generator().manual_seed(0))


def _reference_cos(model_dir: Path, processor_dir: Path, images: torch.Tensor, prompts: list[str]) -> tuple:
    """(cosine [B], image embeddings [B, D] unit-norm, logit scale) computed independently of megaflow."""
    model = CLIPModel.from_pretrained(model_dir).eval()
    processor = CLIPProcessor.from_pretrained(processor_dir)
    arrays = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    pil = [Image.fromarray(a) for a in arrays]
    with torch.no_grad():
        pixels = processor(images=pil, return_tensors="pt")["pixel_values"]
        img = model.get_image_features(pixel_values=pixels)
        img = img if isinstance(img, torch.Tensor) else img.pooler_output
        tokens = processor.tokenizer(prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
        txt = model.get_text_features(**tokens)
        txt = txt if isinstance(txt, torch.Tensor) else txt.pooler_output
    img = img / img.norm(dim=-1, keepdim=True)
    txt = txt / txt.norm(dim=-1, keepdim=True)
    return (img * txt).sum(-1), img, float(model.logit_scale.detach().exp())


def test_clipscore_matches_an_independent_computation(dirs, images):
    reward = build_reward("clipscore", path=str(dirs["clip"]), batch_size=2)  # 2 batches of images and prompts
    scores = reward(images, PROMPTS)
    cos, _, _ = _reference_cos(dirs["clip"], dirs["clip"], images, PROMPTS)
    assert scores.shape == (3,) and scores.dtype == torch.float32
    assert (cos.abs() > 1e-3).all()  # a real similarity, not a constant
    torch.testing.assert_close(scores, 2.5 * cos.clamp(min=0), atol=1e-5, rtol=0)
    prefixed = build_reward("clipscore", path=str(dirs["clip"]), w=1.0, prefix="A photo depicts ")(images, PROMPTS)
    cos_p, _, _ = _reference_cos(dirs["clip"], dirs["clip"], images, [f"A photo depicts {p}" for p in PROMPTS])
    torch.testing.assert_close(prefixed, cos_p.clamp(min=0), atol=1e-5, rtol=0)


def test_pickscore_matches_an_independent_computation(dirs, images):
    reward = build_reward("pickscore", path=str(dirs["pick"]), processor_path=str(dirs["pick_proc"]))
    scores = reward(images, PROMPTS)
    cos, _, logit_scale = _reference_cos(dirs["pick"], dirs["pick_proc"], images, PROMPTS)
    assert scores.shape == (3,) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, logit_scale * cos, atol=1e-5, rtol=0)
    scaled = build_reward("pickscore", path=str(dirs["pick"]), processor_path=str(dirs["pick_proc"]), scale=1 / 26)
    torch.testing.assert_close(scaled(images, PROMPTS), logit_scale * cos / 26, atol=1e-5, rtol=0)


def _laion_mlp(width: int) -> nn.Sequential:
    """The published head's layout, written out here: Linear/Dropout, no activations."""
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(width, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                         nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1)).eval()


def test_aesthetic_matches_an_independent_computation(dirs, images, tmp_path):
    _, img, _ = _reference_cos(dirs["clip"], dirs["clip"], images, PROMPTS)
    mlp = _laion_mlp(16)
    torch.save({f"layers.{k}": v for k, v in mlp.state_dict().items()}, tmp_path / "head.pth")
    reward = build_reward("aesthetic", clip_path=str(dirs["clip"]), head_path=str(tmp_path / "head.pth"))
    scores = reward(images, PROMPTS)
    assert scores.shape == (3,) and scores.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(scores, mlp(img).squeeze(-1), atol=1e-5, rtol=0)
    linear = {"weight": torch.randn(1, 16), "bias": torch.randn(1)}
    save_file(linear, tmp_path / "linear.safetensors")
    plain = build_reward("aesthetic", clip_path=str(dirs["clip"]), head_path=str(tmp_path / "linear.safetensors"))
    torch.testing.assert_close(plain(images, PROMPTS), img @ linear["weight"][0] + linear["bias"], atol=1e-5, rtol=0)


def _one_line_error(name: str, **kwargs) -> str:
    with pytest.raises(ValueError) as e:
        build_reward(name, **kwargs)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def test_bad_files_are_one_line(dirs, tmp_path):
    assert "reward.kwargs.clipscore.path" in _one_line_error("clipscore", path=str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    assert "no config.json" in _one_line_error("clipscore", path=str(tmp_path / "empty"))
    assert "or name one with processor_path" in _one_line_error("pickscore", path=str(dirs["pick"]))  # none there
    assert "w must be a finite number" in _one_line_error("clipscore", path=str(dirs["clip"]), w="big")
    assert "batch_size must be" in _one_line_error("clipscore", path=str(dirs["clip"]), batch_size=0)
    assert "no such file" in _one_line_error("aesthetic", clip_path=str(dirs["clip"]),
                                             head_path=str(tmp_path / "head.pth"))
    torch.save({"fc.weight": torch.zeros(1, 16)}, tmp_path / "odd.pt")
    assert "unknown layout" in _one_line_error("aesthetic", clip_path=str(dirs["clip"]),
                                               head_path=str(tmp_path / "odd.pt"))
    save_file({"weight": torch.zeros(1, 8), "bias": torch.zeros(1)}, tmp_path / "narrow.safetensors")
    assert "needs 16" in _one_line_error("aesthetic", clip_path=str(dirs["clip"]),
                                         head_path=str(tmp_path / "narrow.safetensors"))
    (tmp_path / "cut.safetensors").write_bytes(b"\x08")
    assert "truncated" in _one_line_error("aesthetic", clip_path=str(dirs["clip"]),
                                          head_path=str(tmp_path / "cut.safetensors"))


def _config(tmp_path: Path, weights: dict[str, float], kwargs: dict[str, dict]):
    lines = ["[reward]", "weights = {" + ", ".join(f"{k} = {v}" for k, v in weights.items()) + "}"]
    for name, kw in kwargs.items():
        lines += [f"[reward.kwargs.{name}]", *(f"{k} = {json.dumps(v)}" for k, v in kw.items())]
    (tmp_path / "run.toml").write_text("\n".join(lines) + "\n")
    return load_config(tmp_path / "run.toml")


def test_preflight_checks_the_model_files(dirs, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = _config(tmp_path, {"clipscore": 1.0}, {"clipscore": {"path": str(dirs["clip"])}})
    assert preflight(cfg, "train") is cfg
    bad = _config(tmp_path, {"clipscore": 1.0}, {"clipscore": {"path": str(tmp_path / "nope")}})
    with pytest.raises(ConfigError, match=r"^reward\.kwargs\.clipscore\.path: .*nope is not a directory$"):
        preflight(bad, "train")
    assert preflight(bad, "show", files=False) is bad  # a config for another machine
    missing = _config(tmp_path, {"aesthetic": 1.0}, {"aesthetic": {"clip_path": str(dirs["clip"])}})
    with pytest.raises(ConfigError, match=r"^reward\.kwargs\.aesthetic\.head_path: .*needs its head"):
        preflight(missing, "train")


def test_rewards_run_in_the_loops_scorer(dirs, images, tmp_path, monkeypatch):
    from megaflow.run.build import build_scorer

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    save_file({"weight": torch.randn(1, 16), "bias": torch.zeros(1)}, tmp_path / "head.safetensors")
    cfg = _config(tmp_path, {"clipscore": 1.0, "aesthetic": 0.5},
                  {"clipscore": {"path": str(dirs["clip"])},
                   "aesthetic": {"clip_path": str(dirs["clip"]), "head_path": str(tmp_path / "head.safetensors")}})
    preflight(cfg, "train")
    with build_scorer(cfg) as scorer:
        result = scorer.submit(images, PROMPTS, [{} for _ in PROMPTS]).result(timeout=120)
    clip, aes = result.components["clipscore"], result.components["aesthetic"]
    assert torch.isfinite(result.total).all()
    torch.testing.assert_close(result.total, clip + 0.5 * aes)
    torch.testing.assert_close(clip, build_reward("clipscore", path=str(dirs["clip"]))(images, PROMPTS))
