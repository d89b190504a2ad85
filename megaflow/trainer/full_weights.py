"""Weights in and out of this rank's model chunks: a strict load with one-line errors and the
full-tensor gather (TP all-gather, then broadcast from the owning pipeline stage) behind
``iter_full_params`` / ``iter_full_grads``."""
from __future__ import annotations

from typing import Callable, Iterator

import torch
from megatron.core import parallel_state as ps

from megaflow.parallel.distributed import current_device


def load_checked(chunk: torch.nn.Module, local_sd: dict[str, torch.Tensor]) -> None:
    """``load_state_dict(strict)`` with a one-line ValueError naming the first mismatched tensor."""
    own = {k: v for k, v in chunk.state_dict().items() if not k.endswith("_extra_state")}
    for name in own:
        if name not in local_sd:
            raise ValueError(f"tensor {name!r} is missing from the weights")
        if tuple(local_sd[name].shape) != tuple(own[name].shape):
            raise ValueError(f"shape mismatch for {name!r}: weights {tuple(local_sd[name].shape)} vs model {tuple(own[name].shape)}")
    extra = [k for k in local_sd if k not in own]
    if extra:
        raise ValueError(f"unexpected tensor {extra[0]!r} for this model")
    chunk.load_state_dict(local_sd, strict=False)


def _owner_table(wm, config) -> dict:
    """"first" / "last" / global block index -> (pp rank, chunk index) that holds it."""
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    stages = [None] if vpp is None else list(range(vpp))
    owners = {i: (r, c) for r in range(pp) for c, v in enumerate(stages) for i in wm.stage_layers(config, r, v)}
    return {"first": (0, 0), "last": (pp - 1, len(stages) - 1), **owners}


def iter_full(runner, local_tensors: Callable[[torch.nn.Module], dict], *, include_buffers: bool = True,
              weight_map=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Shared gather loop of ``ModelRunner.iter_full_params`` / ``Trainer.iter_full_grads`` (see there):
    ``runner`` has ``family``, ``config`` and ``chunks``; ``local_tensors(chunk)`` names the tensors to gather;
    ``weight_map``: the table of tensors to gather (default the family's; the LoRA adapters have their own)."""
    wm, cfg = weight_map or runner.family.weight_map, runner.config
    owners = _owner_table(wm, cfg)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    tp_group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    pp_group, pp_size = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_world_size()
    chunks = runner.chunks
    tables = [local_tensors(c) for c in chunks]
    for m in wm.param_maps(cfg):
        if m.buffer and not include_buffers:
            continue
        owner_pp, chunk_idx = owners[m.layer if m.layer is not None else m.stage]
        full = None
        if owner_pp == pp_rank:
            local_name = m.megatron
            if m.layer is not None:
                start = chunks[chunk_idx].global_layer_numbers[0]
                local_name = m.megatron.replace(f"layers.{m.layer}.", f"layers.{m.layer - start}.", 1)
            full = tables[chunk_idx][local_name].detach()
            if m.split_dim is not None and tp > 1:
                parts = [torch.empty_like(full) for _ in range(tp)]
                torch.distributed.all_gather(parts, full.contiguous(), group=tp_group)
                full = torch.cat(parts, dim=m.split_dim)
        if pp_size > 1:
            src = torch.distributed.get_global_rank(pp_group, owner_pp)
            meta = [(tuple(full.shape), full.dtype) if full is not None else None]
            torch.distributed.broadcast_object_list(meta, src=src, group=pp_group)
            if full is None:
                full = torch.empty(meta[0][0], dtype=meta[0][1], device=current_device())
            torch.distributed.broadcast(full, src=src, group=pp_group)
        yield m.megatron, full
