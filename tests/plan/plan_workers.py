"""Rank function for tests/plan/test_plan.py: measured memory of a tiny megatron trainer on one process.

Module-level functions only: pickled by reference into the rank.
"""
from __future__ import annotations

import megaflow  # noqa: F401  (import guards before megatron)
import torch

from megaflow.parallel.dims import ParallelDims
from megaflow.parallel.distributed import destroy_distributed, init_distributed


def measure_rank(case_path: str) -> dict:
    """Autograd's saved bytes of one forward (no recompute), and the peak RSS of building the trainer
    (weights, grad buffer, optimizer) plus one train step above the RSS before building it."""
    from megaflow.models.registry import get_family
    from megaflow.testing.memory import malloc_returns_memory, peak_rss, saved_tensor_bytes
    from megaflow.trainer.runner import Trainer, adam_config, rectified_flow_microbatch

    malloc_returns_memory()
    case = torch.load(case_path, weights_only=False)
    init_distributed(ParallelDims(), seed=0)
    family = get_family(case["family"])
    cfg = family.config_from_diffusers(case["dcfg"])
    mbs = []
    for b in case["batches"]:
        mb = rectified_flow_microbatch(b["x0"], b["noise"], b["sigma"], b["encoder_hidden_states"],
                                       b.get("pooled_projections"))
        mb.update({k: b[k] for k in ("txt_ids", "img_ids", "guidance") if k in b})
        mbs.append(mb)

    def build_and_step():
        eng = Trainer(cfg, family=case["family"], spec="local",
                      optimizer_config=adam_config(lr=1e-4, distributed=True))
        eng.train_step(mbs)
        return eng

    eng, peak = peak_rss(build_and_step)
    params = [p for c in eng.chunks for p in c.parameters()]
    _, saved = saved_tensor_bytes(lambda: eng.model[0](**family.model_inputs(cfg, mbs[0])), exclude=params)
    destroy_distributed()
    return {"saved": saved, "peak_rss": peak, "params": sum(p.numel() for p in params)}


def measure_saved_rank(case_path: str) -> int:
    """Autograd's saved bytes of one forward (no recompute) of the tiny model with LoRA adapters on
    ``case["targets"]`` (base frozen), local layers at TP=1."""
    from megaflow.models.common.lora import LoRASettings
    from megaflow.models.registry import get_family
    from megaflow.testing.memory import saved_tensor_bytes
    from megaflow.trainer.runner import Trainer, adam_config, rectified_flow_microbatch

    case = torch.load(case_path, weights_only=False)
    init_distributed(ParallelDims(), seed=0)
    family = get_family(case["family"])
    cfg = family.config_from_diffusers(case["dcfg"])
    b = case["batches"][0]
    mb = rectified_flow_microbatch(b["x0"], b["noise"], b["sigma"], b["encoder_hidden_states"], b.get("pooled_projections"))
    mb.update({k: b[k] for k in ("txt_ids", "img_ids", "guidance") if k in b})
    eng = Trainer(cfg, family=case["family"], spec="local", optimizer_config=adam_config(lr=1e-4, distributed=True),
                  lora=LoRASettings(rank=4, alpha=8.0, targets=tuple(case["targets"])))
    params = [p for c in eng.chunks for p in c.parameters()]
    _, saved = saved_tensor_bytes(lambda: eng.model[0](**family.model_inputs(cfg, mb)), exclude=params)
    destroy_distributed()
    return saved
