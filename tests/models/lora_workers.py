"""Rank functions and the diffusers + PEFT reference of tests/models/test_lora.py."""
from __future__ import annotations

import megaflow  # noqa: F401  (import guards before megatron)
import torch

from megaflow.parallel.dims import ParallelDims
from megaflow.parallel.distributed import destroy_distributed, init_distributed

PEFT_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]
RANK, ALPHA = 4, 8.0


def peft_model(dcfg: dict, *, seed: int = 7, lora_seed: int = 3):
    """(diffusers SD3 with a PEFT LoRA on every attention projection and MLP linear of both streams, A and B
    random; its base state dict; its adapter state dict under PEFT's names)."""
    from peft import LoraConfig, get_peft_model_state_dict

    from megaflow.models.sd3 import tiny
    model = tiny.diffusers_model(dcfg, seed=seed)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=PEFT_TARGETS, init_lora_weights=True))
    g = torch.Generator().manual_seed(lora_seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    adapters = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    return model, base, adapters


def peft_sft_reference(model, batches) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean rectified-flow loss over ``batches`` and the grads of the LoRA tensors (PEFT names)."""
    from megaflow.models.common.tiny import noised
    from megaflow.models.sd3 import tiny
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
        p.grad = None
    total = 0.0
    for b in batches:
        v = tiny.diffusers_velocity(model, noised(b), b["sigma"], b["encoder_hidden_states"], b["pooled_projections"])
        loss = torch.nn.functional.mse_loss(v, b["noise"] - b["x0"]) / len(batches)
        loss.backward()
        total += float(loss)
    return total, {n.replace(".default", ""): p.grad.clone() for n, p in model.named_parameters() if "lora_" in n}


def lora_engine(dcfg: dict, dims: ParallelDims, *, optimizer: bool = True):
    from megaflow.models.common.lora import LoRASettings
    from megaflow.models.sd3 import from_diffusers
    from megaflow.trainer.runner import Trainer, adam_config

    init_distributed(dims, seed=1234)
    cfg = from_diffusers(dcfg, tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
                         sequence_parallel=dims.sp)
    opt = adam_config(lr=1e-3, weight_decay=0.0, grad_clip=0.0, distributed=True) if optimizer else None
    return Trainer(cfg, spec="local", optimizer_config=opt, lora=LoRASettings(rank=RANK, alpha=ALPHA))


def adapter_grads(eng) -> dict[str, torch.Tensor]:
    """Full adapter grads (PEFT names), gathered over TP/PP like the weights."""
    from megaflow.trainer.full_weights import iter_full
    local = lambda chunk: {n: p.main_grad for n, p in chunk.named_parameters() if p.requires_grad}  # noqa: E731
    out = {}
    for name, t in iter_full(eng, local, include_buffers=False, weight_map=eng.lora_map):
        out.update(eng.lora_map.megatron_to_diffusers(name, t.clone(), eng.config))
    return out


def parity_rank(case_path: str) -> dict:
    """For each layout (TP=2, TP=2+SP, PP=2): base + PEFT adapters loaded, SFT forward/backward; the loss and
    the adapter grads; then whether the frozen base got grads or optimizer slots."""
    from megaflow.trainer.runner import rectified_flow_loss, rectified_flow_microbatch
    case = torch.load(case_path, weights_only=False)
    mbs = [rectified_flow_microbatch(b["x0"], b["noise"], b["sigma"], b["encoder_hidden_states"],
                                     b["pooled_projections"]) for b in case["batches"]]
    out = {}
    for label, dims in (("tp2", ParallelDims(tp=2)), ("tp2sp", ParallelDims(tp=2, sp=True)), ("pp2", ParallelDims(pp=2))):
        eng = lora_engine(case["dcfg"], dims)
        eng.load_diffusers_state_dict(case["base"])
        eng.load_adapters(case["adapters"])
        eng.optimizer.zero_grad()
        results = eng.forward_backward(mbs, rectified_flow_loss)
        loss = float(torch.stack([r["loss"] for r in results]).mean()) if results else None
        grads = adapter_grads(eng)
        chunk = eng.chunks[0]
        trainable = sorted({n.rsplit(".", 2)[-2] for n, p in chunk.named_parameters() if p.requires_grad})
        in_optimizer = sum(p.numel() for g in eng.optimizer.param_groups for p in g["params"])
        in_ddp = sum(p.numel() for p in eng.model[0].params_with_grad)
        adapter_numel = sum(p.numel() for n, p in chunk.named_parameters() if n.endswith((".lora.a", ".lora.b")))
        out[label] = dict(loss=loss, grads=grads, trainable=trainable, in_optimizer=in_optimizer,
                          adapter_numel=adapter_numel, in_ddp=in_ddp)
    destroy_distributed()
    return out
