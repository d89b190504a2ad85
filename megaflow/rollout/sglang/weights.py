"""Weights over the wire to SGLang: one flattened bucket (SGLang's format for the ``transformer`` module) as one
``UpdateWeightFromTensorReqInput``. Design notes: docs/design/rollout.md.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from sglang.multimodal_gen.runtime.entrypoints.post_training.io_struct import UpdateWeightFromTensorReqInput
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

from megaflow.rollout.sglang import plugin, weight_checks

TARGET_MODULE = "transformer"
KEEP_KEY = plugin.KEEP_KEY
"""Payload key naming a staging slot whose mapping the worker keeps between updates (SGLang ignores it)."""


def gpu_uuid(device: torch.device) -> str:
    """The UUID of ``device``'s physical GPU, as torch reports it (SGLang strips NVML's 'GPU-' prefix)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def flatten(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list]:
    """(flat uint8 tensor, metadata) of named tensors, packed by SGLang's own ``FlattenedTensorBucket``."""
    bucket = FlattenedTensorBucket(named_tensors=[(n, t.detach().contiguous()) for n, t in named_tensors])
    return bucket.get_flattened_tensor(), bucket.get_metadata()


def update_request(flat: torch.Tensor, metadata: Sequence, *, lora: tuple[float, int] | None = None,
                   keep: str | None = None, kept: bool = False, digests: dict[str, str] | None = None
                   ) -> UpdateWeightFromTensorReqInput:
    """The request loading one bucket into the DiT. ``metadata``: ``FlattenedTensorMetadata`` fields; ``lora``:
    (alpha, rank) for adapters; ``keep`` / ``kept``: staging-slot key (memory sent / already held); ``digests``:
    checked by the worker."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"a flattened bucket is a 1-D uint8 tensor, got {flat.dtype} with shape {tuple(flat.shape)}")
    if flat.is_cuda:
        monkey_patch_torch_reductions()
        uuids = [gpu_uuid(flat.device)]
    else:
        flat.share_memory_()  # no-op when it is there already
        uuids = None
    meta = [FlattenedTensorMetadata(name=m.name, shape=torch.Size(m.shape), dtype=m.dtype, start_idx=int(m.start_idx),
                                    end_idx=int(m.end_idx), numel=int(m.numel)) for m in metadata]
    if kept and not keep:
        raise ValueError("kept=True names a staging slot: pass its key as keep")
    extra = {**({KEEP_KEY: keep} if keep else {}), **({weight_checks.DIGESTS_KEY: dict(digests)} if digests else {})}
    sent = {} if kept else {"flattened_tensor": flat}
    payload = {TARGET_MODULE: {**sent, "metadata": meta, **extra}}
    mode = {} if lora is None else {"weight_update_mode": "lora_merge", "lora_alpha": lora[0], "lora_rank": lora[1]}
    return UpdateWeightFromTensorReqInput(
        serialized_named_tensors=[MultiprocessingSerializer.serialize(payload, output_str=True)],
        payload_gpu_uuids=uuids, load_format="flattened_bucket", target_modules=[TARGET_MODULE], **mode)
