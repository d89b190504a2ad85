"""Which tensors of a dist checkpoint a one-process read (``load_full_state_dict``: export, ``to-diffusers``) takes:
the model's, at the shapes its ``megaflow_model.json`` (family, diffusers config) gives them.

Invariant: every tensor read is one the model has, at its shape (a LoRA adapter: two dimensions, no larger than
the weight it adapts), decided from the checked metadata before any tensor is allocated or read; anything else is
refused in one line (a sparse file may claim gigabytes).
"""
from __future__ import annotations

import math
from pathlib import Path

ADAPTER_SUFFIXES = (".lora.a", ".lora.b")  # megatron names of LoRA adapter tensors (megaflow.models.common.lora)
SKIPPED = ("optimizer",)  # a one-process read takes no optimizer state


def diffusers_shapes(family, diffusers_config: dict) -> dict[str, tuple]:
    """Tensor shapes of ``family``'s diffusers class for this config (built on the meta device)."""
    import diffusers
    import torch

    cls = getattr(diffusers, family.diffusers_class)
    with torch.device("meta"):
        model = cls.from_config(diffusers_config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def model_shapes(meta: dict, where: Path) -> dict[str, tuple]:
    """Global megatron name -> shape of every tensor of the model ``meta`` (a checkpoint's megaflow_model.json)
    describes; ValueError of one line naming ``where`` when it describes none."""
    import torch

    from megaflow.models.registry import get_family

    family, dconfig = meta.get("family"), meta.get("diffusers_config")
    if not isinstance(family, str) or not isinstance(dconfig, dict):
        raise ValueError(f"{where}: family {str(family)[:40]!r} / diffusers_config of the wrong type")
    try:
        fam = get_family(family)
        config = fam.config_from_diffusers(dconfig)
        shapes = diffusers_shapes(fam, dconfig)
        full = fam.weight_map.to_megatron_full({k: torch.empty(s, device="meta") for k, s in shapes.items()}, config)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{where}: describes no model megaflow can build ({type(e).__name__}: {str(e)[:120]})") \
            from None
    return {k: tuple(v.shape) for k, v in full.items()}


def tensors_to_read(directory: Path, metadata, expected: dict[str, tuple], family: str, shadow: str | None) -> dict:
    """Checkpoint key -> TensorStorageMetadata of the tensors to read: the model's and, with ``shadow``, that
    shadow's copies of them (``<shadow>.<name>``); the optimizer's and other shadows' copies (a model tensor under
    another prefix: the EMA, theta_old, an algorithm's own) skipped. ValueError naming the first tensor that is
    neither the model's at its shape nor such a copy, before anything is read."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = {}
    for key, item in metadata.state_dict_metadata.items():
        head, _, rest = key.partition(".")
        if type(item) is not TensorStorageMetadata or head in SKIPPED:
            continue
        size = tuple(item.size)
        name = rest if head == shadow else key
        if _fits(name, size, expected):
            out[key] = item
        elif head != shadow and key not in expected and _fits(rest, size, expected):
            continue  # another shadow's copy, not read
        else:
            want = f"the model's is {expected[name]}" if name in expected else \
                f"which a {family} model of its config does not have"
            raise ValueError(f"{directory / '.metadata'}: tensor {key!r} of shape {size[:8]}, {want}; not read")
    return out


def _fits(name: str, size: tuple, expected: dict[str, tuple]) -> bool:
    if name in expected:
        return size == expected[name]
    if not name.endswith(ADAPTER_SUFFIXES):
        return False
    base = expected.get(name[:-len(".lora.a")] + ".weight")
    return base is not None and len(size) == 2 and math.prod(size) <= math.prod(base)
