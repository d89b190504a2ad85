"""``aesthetic``: the LAION aesthetic predictor v2 shape: a normalised CLIP image embedding (``clip_path``)
through a small head (``head_path``, tensors only). Design notes: docs/design/rewards.md.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from megaflow.config.reward_files import check_model_reward
from megaflow.rewards.base import ImageBatch, Reward
from megaflow.rewards.clip import ClipEmbedder, check_options

MLP_LINEARS = (0, 2, 4, 6, 7)  # indices of the Linear layers in the published nn.Sequential
MLP_DROPOUTS = {1: 0.2, 3: 0.2, 5: 0.1}


def read_state_dict(path: str | Path, what: str = "aesthetic head", *, nested: str | None = None
                    ) -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` file or a torch-saved state dict (CPU, no code run); ``what`` starts
    the one-line ValueError about a file that is neither. ``nested``: a torch-saved dict holding the state dict
    under this key (a training checkpoint, e.g. ``{"state_dict": ..., "epoch": ...}``) gives that one."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        return load_file(str(path), device="cpu")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is the same user mistake
        why = " ".join(str(e).split())  # torch's unpickling messages span lines: one line, shortened
        raise ValueError(f"{what} {path}: not a torch state dict ({type(e).__name__}: {why[:200]})") from None
    if nested is not None and isinstance(obj, dict) and isinstance(obj.get(nested), dict):
        obj = obj[nested]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{what} {path}: expected a state dict of tensors, got {type(obj).__name__}")
    return obj


def mlp_from_state(state: dict[str, torch.Tensor]) -> nn.Sequential:
    """The published MLP's ``nn.Sequential`` (widths from ``state``'s ``layers.N.weight``, dropouts as published),
    weights not loaded."""
    layers: list[nn.Module] = []
    for i in range(max(MLP_LINEARS) + 1):
        if i in MLP_LINEARS:
            out_dim, in_dim = state[f"layers.{i}.weight"].shape
            layers.append(nn.Linear(in_dim, out_dim))
        else:
            layers.append(nn.Dropout(MLP_DROPOUTS[i]))
    return nn.Sequential(*layers)


def load_head(path: str | Path) -> nn.Module:
    """The head of ``path`` in eval mode (the module's design notes: the two accepted
    layouts); maps [B, D] to [B, 1]."""
    state = read_state_dict(path)
    mlp_keys = {f"layers.{i}.{p}" for i in MLP_LINEARS for p in ("weight", "bias")}
    if set(state) == mlp_keys:
        head: nn.Module = nn.Sequential()
        head.add_module("layers", mlp_from_state(state))
    elif set(state) == {"weight", "bias"} and state["weight"].ndim == 2:
        head = nn.Linear(state["weight"].shape[1], state["weight"].shape[0])
    else:
        raise ValueError(f"aesthetic head {path}: unknown layout (keys {sorted(state)[:12]}); expected the LAION "
                         "MLP's layers.{0,2,4,6,7}.{weight,bias} or a linear head's weight [1, D] and bias [1]")
    try:
        head.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    except RuntimeError as e:
        raise ValueError(f"aesthetic head {path}: inconsistent layer shapes ({str(e).splitlines()[-1].strip()})") from None
    return head.eval().requires_grad_(False)


def head_widths(head: nn.Module) -> tuple[int, int]:
    """(input, output) widths of a head from ``load_head``."""
    linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
    return linears[0].in_features, linears[-1].out_features


class AestheticReward(Reward):
    """Predicted aesthetic score: ``head(normalise(clip_image_embedding))`` (see the module's design notes)."""

    name = "aesthetic"

    def __init__(self, *, clip_path: str, head_path: str, device: str = "cpu", batch_size: int = 16):
        check_model_reward(self.name, {"clip_path": clip_path, "head_path": head_path})
        check_options(self.name, device, batch_size)
        head = load_head(head_path)
        self.clip = ClipEmbedder(clip_path, device=device, batch_size=batch_size)
        width, out = head_widths(head)
        projection = self.clip.model.config.projection_dim
        if width != projection or out != 1:
            raise ValueError(f"reward 'aesthetic': head {head_path} maps {width} -> {out} but needs "
                             f"{projection} (the CLIP projection width of {clip_path}) -> 1")
        self.head, self.device = head.to(device), device

    def __call__(self, images: ImageBatch, prompts: Sequence[str],
                 metadata: Sequence[dict] | None = None) -> torch.Tensor:
        emb = self.clip.images(images)
        with torch.no_grad():
            return self.head(emb.to(self.device)).squeeze(-1).float().cpu()
