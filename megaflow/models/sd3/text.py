"""SD3 text conditioning as SGLang computes it for a request with ``max_sequence_length``.
Imports torch only: ``megaflow export`` copies it into an SD3 export as ``encode_prompts.py``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.no_grad()
def encode_prompts(pipe, prompts: list[str], *, max_sequence_length: int,
                   batch: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_embeds [N, 2 * L, D], pooled [N, P]) as SGLang's SD3 pipeline computes them with
    ``max_sequence_length = L`` (CLIP prompts padded to L too, unlike diffusers' 77)."""
    embeds, pooled = [], []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        clip_h, clip_p = [], []
        for tok, enc in ((pipe.tokenizer, pipe.text_encoder), (pipe.tokenizer_2, pipe.text_encoder_2)):
            ids = tok(chunk, padding="max_length", max_length=max_sequence_length, truncation=True,
                      return_tensors="pt").input_ids
            out = enc(ids, output_hidden_states=True)
            clip_h.append(out.hidden_states[-2])
            clip_p.append(out.text_embeds)
        ids = pipe.tokenizer_3(chunk, padding="max_length", max_length=max_sequence_length, truncation=True,
                               add_special_tokens=True, return_tensors="pt").input_ids
        t5 = pipe.text_encoder_3(ids).last_hidden_state
        clip = torch.cat(clip_h, dim=-1)
        clip = F.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        embeds.append(torch.cat([clip, t5], dim=-2).float())
        pooled.append(torch.cat(clip_p, dim=-1).float())
    return torch.cat(embeds), torch.cat(pooled)
