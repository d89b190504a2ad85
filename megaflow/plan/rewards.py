"""The reward models in ``megaflow plan`` (standard library only).

Design notes: docs/design/plan.md.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megaflow.config.reward_files import MODEL_REWARDS
from megaflow.config.schema import MegaflowConfig
from megaflow.plan.dit import INFERENCE_LIVE
from megaflow.plan.weights import safetensors_numel, transformers_weights

REWARD_BYTES = 4  # float32: megaflow.rewards.clip.load_clip, imagereward's loader (.float()); hpsv2 as published
DEFAULT_DEVICE, DEFAULT_BATCH = "cpu", 16  # the model rewards' defaults (megaflow.rewards.clip.ClipEmbedder)
MODELS_ITEM, SCORING_ITEM = "reward models", "reward scoring activations"


@dataclass(frozen=True)
class RewardModel:
    """A model reward's published model: its parameters, a separately loaded head's, and its image tower."""

    params: int
    source: str
    head: int = 0          # a head read from its own file (not part of the model directory)
    width: int = 1024      # image tower: hidden size, attention heads, tokens at its input size
    heads: int = 16
    tokens: int = 257      # 224 px / patch 14 = 16 x 16 patches + the class token
    kind: str = "clip"     # megaflow.rewards.clip.shared_model's kind: one copy per (kind, directory, device)


# Parameter counts: the CLIP ones are sum(p.numel()) of transformers' CLIPModel built from the published config.json
# (openai/clip-vit-large-patch14: 427,616,513 = vision 303.2M + text 123.1M + projections; CLIP ViT-H/14 as in
# yuvalkirstain/PickScore_v1 and laion/CLIP-ViT-H-14-laion2B-s32B-b79K: 986,109,441 = vision 630.8M + text 353.0M,
# open_clip's docs/model_profile.csv lists ViT-H-14 at 986.11M). HPS v2 / v2.1 fine-tune open_clip's ViT-H-14
# (HPSv2's create_model_and_transforms("ViT-H-14")), the same count. ImageReward (THUDM/ImageReward; what
# megaflow.rewards.imagereward loads of it): BLIP ViT-L/16 at 224 px 303,301,632 + the BERT-base text encoder with
# cross-attention to the 1024-wide image tokens (vocab 30524, 12 layers, no token-type table, no pooler)
# 141,977,088 + the MLP 768-1024-128-64-16-1 927,969 = 446,206,689 (ImageReward.pt also holds BLIP's unused
# vision/text projections, 459,264 more: x 4 bytes = 1.79 GB, the file's size). The LAION aesthetic head is that
# MLP shape too (927,969). tests/plan/test_plan.py builds each from its config on the meta device and compares.
REWARD_MODELS = {
    "clipscore": RewardModel(427_616_513, "CLIP ViT-L/14, openai/clip-vit-large-patch14"),
    "pickscore": RewardModel(986_109_441, "CLIP ViT-H/14, yuvalkirstain/PickScore_v1", width=1280),
    "aesthetic": RewardModel(427_616_513, "CLIP ViT-L/14 + the LAION aesthetic MLP", head=927_969),
    "hpsv2": RewardModel(986_109_441, "OpenCLIP ViT-H-14, HPS v2", width=1280, kind="hpsv2"),
    "imagereward": RewardModel(446_206_689, "BLIP ViT-L/16 + BERT-base + MLP, ImageReward", tokens=197,
                               kind="imagereward"),
}


@dataclass(frozen=True)
class RewardLoad:
    """One configured model reward: what it puts on its device."""

    name: str
    model: int             # parameters of the model (one copy for the rewards with the same ``key``)
    head: int              # parameters of its own head
    source: str
    device: str
    batch: int
    scoring: float         # bytes of one scoring batch's activations
    key: tuple

    @property
    def on_gpu(self) -> bool:
        return isinstance(self.device, str) and self.device.startswith("cuda")


def _local_model(path: object) -> tuple[int, dict] | None:
    """(floating-point parameters, config.json) of a local transformers model directory; None when it is not
    here or holds no safetensors weights."""
    root = Path(path) if isinstance(path, str) and path else None
    files = transformers_weights(root) if root is not None and root.is_dir() else []
    if not files:
        return None
    conf = root / "config.json"
    return safetensors_numel(files, floating=True), (json.loads(conf.read_text()) if conf.is_file() else {})


def _head(row: RewardModel, path: object) -> int:
    """A separate head's parameters: a local ``.safetensors`` head's, else the table's."""
    if row.head and isinstance(path, str) and path.endswith(".safetensors") and Path(path).is_file():
        return safetensors_numel([path], floating=True)
    return row.head


def scoring_bytes(batch: int, tokens: int, width: int, heads: int) -> float:
    """One no-grad float32 batch through a ViT image tower (the module's design notes)."""
    return batch * REWARD_BYTES * (tokens * width * INFERENCE_LIVE + heads * tokens * tokens)


def reward_load(name: str, kwargs: dict) -> RewardLoad:
    """What model reward ``name`` (a key of ``REWARD_MODELS``) with ``kwargs`` loads (the module's design notes)."""
    row = REWARD_MODELS[name]
    # a row whose reward is not in MODEL_REWARDS yet (added on its own branch): its model under "path"
    model_key, _, head_key, _ = MODEL_REWARDS.get(name, ("path", None, None, ""))
    path = kwargs.get(model_key)
    local = _local_model(path)
    params, source = row.params, f"{row.source} (built-in table)"
    width, heads, tokens = row.width, row.heads, row.tokens
    if local is not None:
        params, vision = local[0], local[1].get("vision_config") or {}
        source = f"{path} (safetensors headers)"
        width, heads = int(vision.get("hidden_size", width)), int(vision.get("num_attention_heads", heads))
        if "image_size" in vision and "patch_size" in vision:
            tokens = (int(vision["image_size"]) // int(vision["patch_size"])) ** 2 + 1
    device, batch = kwargs.get("device", DEFAULT_DEVICE), kwargs.get("batch_size", DEFAULT_BATCH)
    batch = batch if isinstance(batch, int) and batch > 0 else DEFAULT_BATCH
    return RewardLoad(name=name, model=params, head=_head(row, kwargs.get(head_key) if head_key else None),
                      source=source, device=device, batch=batch, scoring=scoring_bytes(batch, tokens, width, heads),
                      key=(row.kind, str(path), str(device)))


def reward_loads(cfg: MegaflowConfig) -> list[RewardLoad]:
    """Every model reward of ``reward.weights`` (a weight-0 one too: it is built and scored, only reported)."""
    r = cfg.reward
    return [reward_load(n, r.kwargs.get(n, {})) for n in r.weights if n in REWARD_MODELS]


def reward_items(cfg: MegaflowConfig, loads: list[RewardLoad]) -> dict[str, float]:
    """The GPU bytes of ``loads`` on a scoring rank: {MODELS_ITEM, SCORING_ITEM}, or {} when none is on a GPU."""
    gpu = [x for x in loads if x.on_gpu]
    if not gpu:
        return {}
    models = {x.key: x.model for x in gpu}
    return {MODELS_ITEM: (sum(models.values()) + sum(x.head for x in gpu)) * REWARD_BYTES,
            SCORING_ITEM: max(x.scoring for x in gpu) * cfg.reward.num_workers}


def scoring_ranks(cfg: MegaflowConfig, hosts) -> set[int]:
    """The ranks that build the rewards: the engine hosts (their scorer), and the driver (rank 0) when
    ``megaflow train`` evaluates on test prompts."""
    return set(hosts) | ({0} if cfg.eval.every and cfg.data.test_prompts else set())


def describe(loads: list[RewardLoad]) -> list[str]:
    """One line per model reward for ``format_plan``."""
    return [f"reward {x.name}: {(x.model + x.head) / 1e6:.1f}M params from {x.source}, float32 on {x.device}"
            + ("" if x.on_gpu else " (not on a GPU: not counted)") for x in loads]
