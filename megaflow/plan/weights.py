"""Parameter counts read from safetensors headers (standard library only): the 8-byte header length, then the
JSON header with every tensor's dtype and shape; the data is never read."""
from __future__ import annotations

import json
from pathlib import Path

FLOATING = ("F64", "F32", "F16", "BF16")


def safetensors_numel(files, *, floating: bool = False) -> int:
    """Elements of every tensor in ``files``; ``floating``: only floating-point ones (a model cast to one float
    dtype keeps its integer buffers, e.g. an older checkpoint's position_ids, apart)."""
    total = 0
    for f in files:
        with Path(f).open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, meta in header.items():
            if name == "__metadata__" or (floating and meta.get("dtype") not in FLOATING):
                continue
            count = 1
            for n in meta["shape"]:
                count *= n
            total += count
    return total


def folder_numel(folder: Path) -> int:
    """Elements of every tensor in a folder's safetensors files (a diffusers component folder)."""
    return safetensors_numel(sorted(folder.glob("*.safetensors")))


def transformers_weights(folder: Path) -> list[Path]:
    """The safetensors files ``from_pretrained`` loads from a transformers model directory: the shards
    ``model.safetensors.index.json`` names, else ``model.safetensors``; [] when neither is there."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        return [folder / s for s in shards if (folder / s).is_file()]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []
