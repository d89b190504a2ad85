"""Helpers shared by the families' ``tiny.py``: random diffusers reference models and SFT reference
losses/grads, the same way for every family (the family passes its diffusers model class).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from megaflow.flow import forward


def random_model(model_class: type, config: dict[str, Any], *, seed: int, is_norm_scale: Callable[[str], bool]):
    """``model_class(**config)`` (fp32, eval) with weights from N(0, 0.05) and q/k norm scales from
    1 + N(0, 0.1), so every tensor visibly affects outputs and grads."""
    torch.manual_seed(seed)
    model = model_class(**config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_norm_scale(name):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model


def noised(b: dict) -> torch.Tensor:
    """x_t = (1 - sigma) x0 + sigma noise for a batch from a family's ``sft_batches``."""
    return forward.noised(b["x0"], b["noise"], b["sigma"])


def sft_reference(model, batches: list[dict],
                  velocity: Callable[[Any, dict], torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean rectified-flow loss over ``batches`` and its grads (diffusers names) for ``model``;
    ``velocity(model, batch)`` is the model's velocity at ``noised(batch)``."""
    model.zero_grad()
    total = 0.0
    for b in batches:
        loss = torch.nn.functional.mse_loss(velocity(model, b), b["noise"] - b["x0"]) / len(batches)
        loss.backward()
        total += float(loss)
    # A parameter the loss never reaches (Qwen-Image's last text-stream MLP) has a zero grad, as megatron's main grads.
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
    return total, grads
