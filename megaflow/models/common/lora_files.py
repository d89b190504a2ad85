"""LoRA adapters on disk as diffusers' ``save_lora_weights`` writes them (what ``load_lora_weights``
loads): ``pytorch_lora_weights.safetensors``, keys ``transformer.<module>.lora_A/B.weight``, the PEFT
config in the header under ``lora_adapter_metadata``; beside it, the same adapter as a PEFT directory
(``adapter_config.json`` + ``adapter_model.safetensors``, what ``PeftModel.from_pretrained`` loads onto the
transformer).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

WEIGHT_NAME = "pytorch_lora_weights.safetensors"
METADATA_KEY = "lora_adapter_metadata"  # diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY
PREFIX = "transformer."
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def adapter_file(path: str | Path) -> Path:
    """``path`` itself, or ``path/pytorch_lora_weights.safetensors`` for a directory."""
    path = Path(path)
    return path / WEIGHT_NAME if path.is_dir() else path


def read_adapter(path: str | Path, *, rank: int, alpha: float) -> dict[str, torch.Tensor]:
    """The transformer's adapter tensors (PEFT names) of a LoRA file or directory; ValueError when
    missing, empty, or its recorded rank / alpha differ from ``rank`` / ``alpha``."""
    from safetensors import safe_open

    file = adapter_file(path)
    if not file.is_file():
        raise ValueError(f"lora.init: {file} not found")
    with safe_open(str(file), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get(METADATA_KEY) or "{}")
        state = {k.removeprefix(PREFIX): f.get_tensor(k) for k in f.keys() if k.startswith(PREFIX)}
    if not state:
        raise ValueError(f"lora.init: {file} has no '{PREFIX}*' adapter tensors")
    saved_rank, saved_alpha = meta.get(PREFIX + "r"), meta.get(PREFIX + "lora_alpha")
    if saved_rank is not None and int(saved_rank) != rank:
        raise ValueError(f"lora.init: {file} has rank {saved_rank}, lora.rank is {rank}")
    if saved_alpha is not None and float(saved_alpha) != float(alpha):
        raise ValueError(f"lora.init: {file} has alpha {saved_alpha}, lora.alpha is {alpha}")
    return state


def write_adapter(directory: str | Path, state: dict[str, torch.Tensor], *, rank: int, alpha: float,
                  pipeline_class: str) -> Path:
    """Write ``state`` (PEFT names) through ``<pipeline_class>.save_lora_weights`` with the LoraConfig
    fields ``load_lora_weights`` reads."""
    import diffusers

    modules = sorted({k.rsplit(".lora_", 1)[0] for k in state})
    getattr(diffusers, pipeline_class).save_lora_weights(
        str(directory), transformer_lora_layers={k: v.contiguous() for k, v in state.items()},
        transformer_lora_adapter_metadata={"r": rank, "lora_alpha": alpha, "target_modules": modules,
                                           "rank_pattern": {}, "alpha_pattern": {}})  # diffusers reads both
    write_peft_adapter(directory, state, rank=rank, alpha=alpha, modules=modules)
    return Path(directory) / WEIGHT_NAME


def write_peft_adapter(directory: str | Path, state: dict[str, torch.Tensor], *, rank: int, alpha: float,
                       modules: list[str]) -> Path:
    """``state`` (PEFT names) as a PEFT adapter directory: ``LoraConfig.save_pretrained``'s adapter_config.json and
    the weights under PEFT's saved names (``base_model.model.<module>.lora_A.weight``)."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, init_lora_weights=False).save_pretrained(
        str(directory))
    save_file({PEFT_PREFIX + k: v.contiguous() for k, v in state.items()}, str(Path(directory) / PEFT_WEIGHTS))
    return Path(directory) / PEFT_WEIGHTS
