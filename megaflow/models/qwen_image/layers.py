"""Qwen-Image's pieces on top of the shared RoPE double-stream block (``megaflow.models.common.rope``):
the 3-axis positions diffusers' ``QwenEmbedRope`` gives (centred image grid, text after the image) and the
joint attention that masks padded text keys. The block itself is the shared ``RopeDoubleLayer``.

Invariant: text positions depend only on the image shape and the token index, never on the mask, so text
padded at the end changes nothing for the real tokens.
"""
from __future__ import annotations

import torch
from megatron.core.transformer.enums import AttnMaskType

from megaflow.models.common.rope import RopeJointAttention, StreamRope, rope_table


def image_positions(frames: int, height: int, width: int) -> torch.Tensor:
    """Positions [frames*height*width, 3] of the packed image tokens (row-major over frame, row, col):
    frame f, and rows / cols centred as QwenEmbedRope(scale_rope=True) does (row r -> r - ceil(height / 2))."""
    f, r, c = torch.meshgrid(torch.arange(frames), torch.arange(height) - (height - height // 2),
                             torch.arange(width) - (width - width // 2), indexing="ij")
    return torch.stack([f, r, c], dim=-1).reshape(-1, 3)


def text_positions(height: int, width: int, num_text: int) -> torch.Tensor:
    """Positions [num_text, 3] of the text tokens: token j at max(height // 2, width // 2) + j on every axis
    (after the image's largest position)."""
    start = max(height // 2, width // 2)
    return (start + torch.arange(num_text))[:, None].expand(num_text, 3)


def qwen_rope(img_shape: tuple[int, int, int], num_text: int, axes_dims: tuple[int, ...], theta: float,
              device: torch.device | None = None) -> StreamRope:
    """The per-stream RoPE tables of one forward (angles in float32, as diffusers computes them)."""
    frames, height, width = img_shape
    ids = torch.cat([image_positions(frames, height, width), text_positions(height, width, num_text)]).to(device)
    cos, sin = rope_table(ids, axes_dims, theta, dtype=torch.float32)
    n = frames * height * width
    return StreamRope(image=(cos[:n], sin[:n]), context=(cos[n:], sin[n:]))


class QwenJointAttention(RopeJointAttention):
    """Joint attention over ``[image; context]`` with a padding mask on the context keys: padded text
    sits at the very end of each sample's tokens, the layout a padding-mask kernel expects."""

    context_first = False
    attn_mask_type = AttnMaskType.padding
