"""``hpsv2``: Human Preference Score v2.1 (Wu et al. 2023), read from files you download (hubs never contacted).

Design notes: docs/design/rewards.md.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Sequence

import torch

from megaflow.config.reward_files import check_model_reward
from megaflow.rewards.base import ImageBatch, Reward
from megaflow.rewards.clip import ClipEmbedder, check_options, shared_model
from megaflow.rewards.openclip import load_openclip, openclip_pixels


def clip_bpe_tokenizer(path: str):
    """The CLIP BPE tokenizer in directory ``path`` with only ``<|startoftext|>`` / ``<|endoftext|>`` special (the
    latter also pads), as OpenCLIP tokenises. A tokenizer saved with another special token keeps splitting it
    out of the text: laion's CLIP tokenizers pad with ``"!"``, which would turn every ``!`` into id 0."""
    from transformers import CLIPTokenizer
    saved = json.loads(CLIPTokenizer.from_pretrained(path, local_files_only=True).backend_tokenizer.to_str())
    bpe = saved["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in bpe["merges"]]
    return CLIPTokenizer(vocab=bpe["vocab"], merges=merges)


class HpsV2(Reward):
    """HPSv2.1: ``cos(image, prompt)`` of the HPS OpenCLIP model (see the module's design notes)."""

    name = "hpsv2"

    def __init__(self, *, path: str | None = None, tokenizer_path: str | None = None, device: str = "cpu",
                 batch_size: int = 16):
        # Both paths are required; None here lets the file check name the missing one and its download.
        check_model_reward(self.name, {"path": path, "tokenizer_path": tokenizer_path})
        check_options(self.name, device, batch_size)
        tokenizer = clip_bpe_tokenizer(tokenizer_path)
        model = shared_model("hpsv2", path, device, functools.partial(load_openclip, path))
        text = model.config.text_config
        if len(tokenizer) != text.vocab_size or tokenizer.eos_token_id != text.eos_token_id:
            raise ValueError(f"reward 'hpsv2': the tokenizer in {tokenizer_path} ({len(tokenizer)} tokens, "
                             f"end-of-text {tokenizer.eos_token_id}) does not fit the checkpoint's text tower "
                             f"({text.vocab_size} tokens, end-of-text {text.eos_token_id}): not the CLIP BPE")
        pixels = functools.partial(openclip_pixels, size=model.config.vision_config.image_size)
        self.clip = ClipEmbedder.of(model, tokenizer, pixels, device=device, batch_size=batch_size)

    def __call__(self, images: ImageBatch, prompts: Sequence[str],
                 metadata: Sequence[dict] | None = None) -> torch.Tensor:
        return self.clip.cosine(images, prompts)
