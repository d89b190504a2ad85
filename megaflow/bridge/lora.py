"""The LoRA sync path: only the adapters move, into SGLang's own LoRA update.

Choice (SGLang 0.5.23's diffusion runtime, read in its ``post_training/weights_updater.py`` and
``layers/lora/linear.py``, run on CPU): ``update_weights_from_tensor(weight_update_mode="lora_merge")``.
It takes PEFT-named A/B tensors in the same flattened-bucket payload as a full update, wraps the DiT's
linears in LoRA layers on first use, and on every update replaces each named layer's adapter (the previous
merge is undone from a snapshot of the base it keeps) and merges ``base + alpha / rank * B @ A`` into the
weight, so sampling runs at full-weight speed. The alternatives: ``set_lora`` reads an adapter from disk
(a write and a read of every adapter per iteration, and a nickname/path cache to defeat); merging on the
trainer side would push every targeted base matrix (most of the model) instead of the adapters.

Stream: ``trainer.iter_full_adapters`` (TP/PP gather of the adapter tensors, PEFT names). Verified: every
engine re-hashes (with its checksum, bridge.checksum) each adapter tensor it now holds against what was sent
(``update_lora(verify=)``).
That the merged weights act as base + scale * B @ A is tested (tests/bridge/test_lora_sync.py: the velocities
the engine samples with equal the LoRA trainer's, also after a second adapter replaced the first) and shows
in every training iteration as ``train/logp_abs_diff_rollout`` (trainer vs engine log-probs of its samples).
The adapters are small, so one request per engine carries all of them.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from megaflow.bridge.base import SyncStream, SyncError, SyncReport


def sync_stream(trainer) -> Iterator[tuple[str, torch.Tensor]]:
    """What a sync moves (collective over trainer ranks): the adapters of a LoRA trainer, else every weight
    under the engine's names."""
    if getattr(trainer, "lora", None) is not None:
        return trainer.iter_full_adapters()
    from megaflow.bridge.convert import engine_named_params
    return engine_named_params(trainer)


class LoRABridge:
    """Pushes the adapters into every engine through SGLang's LoRA merge (see the module docstring)."""

    mode = "lora"

    def __init__(self, engines: Sequence, *, alpha: float, rank: int, verify: bool = True):
        if not engines:
            raise ValueError("LoRABridge needs at least one engine")
        self.engines, self.alpha, self.rank, self.verify = list(engines), float(alpha), int(rank), verify

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        stream = SyncStream(named_tensors, digest=False)
        named = list(stream)
        if not named:
            raise ValueError("LoRA sync got no adapter tensors")
        for engine in self.engines:
            result = engine.update_lora(named, alpha=self.alpha, rank=self.rank, verify=self.verify)
            if not result.ok:
                raise SyncError(f"LoRA update of engine {getattr(engine, 'engine_id', '?')} failed: {result.message}")
        report = stream.report(self.mode, num_buckets=1)
        report.verified = self.verify
        report.message = f"{len(named)} adapter tensors to {len(self.engines)} engine(s)"
        return report
