"""LoRA on the megatron SD3: forward and adapter grads against diffusers + PEFT (the independent reference),
at one process and at TP=2, TP=2+SP and PP=2; a fresh adapter (B = 0) gives exactly the base (bit for bit: the
adapter-off reference of the same engine; <= 1e-6 vs the megatron model without LoRA, whose DDP memory layout
differs); only adapters train (the only parameters with grads, in DDP's grad buffers and in the optimizer).

Needs: CPU; the parallel test runs 2 gloo processes (one launch, three layouts). Tolerances: velocity
<= 1e-5 (fp32; measured ~2e-7), loss <= 1e-6, adapter grads <= 1e-5 relative to the largest grad.
"""
from __future__ import annotations

import pytest
import torch

import lora_workers
from megaflow.models.common.tiny import noised
from megaflow.models.sd3 import tiny
from megaflow.parallel.dims import ParallelDims
from megaflow.parallel.distributed import destroy_distributed
from megaflow.testing.dist import run_multiprocess

DCFG = tiny.tiny_config(qk_norm="rms_norm", dual_attention_layers=(0,))


def _velocity(eng, b):
    return eng.velocity(noised(b), b["sigma"], b["encoder_hidden_states"], b["pooled_projections"])


def test_lora_forward_matches_peft_and_base_is_exact():
    from megaflow.trainer.runner import BaseReference, Trainer
    torch.set_num_threads(1)
    model, base, adapters = lora_workers.peft_model(DCFG)
    b = tiny.sft_batches(DCFG, num_microbatches=1, batch=2, context_len=6, seed=2)[0]
    with torch.no_grad():
        expected = tiny.diffusers_velocity(model, noised(b), b["sigma"], b["encoder_hidden_states"],
                                           b["pooled_projections"])
        model.disable_adapters()
        expected_base = tiny.diffusers_velocity(model, noised(b), b["sigma"], b["encoder_hidden_states"],
                                                b["pooled_projections"])
    eng = lora_workers.lora_engine(DCFG, ParallelDims())
    try:
        eng.load_diffusers_state_dict(base)
        fresh = _velocity(eng, b)  # B = 0: the adapters add exactly nothing
        plain = Trainer(eng.config, spec="local")  # the same megatron model without LoRA
        plain.load_diffusers_state_dict(base)
        # not bit-equal: DDP lays out the trainable params (all vs only adapters) differently, and the CPU
        # GEMMs round by memory layout (measured 6e-8); the adapter itself adds exact zeros (torch.equal below)
        assert (fresh - _velocity(plain, b)).abs().max() <= 1e-6
        with torch.no_grad():
            for a in eng.chunks[0].modules():
                if hasattr(a, "enabled") and hasattr(a, "b"):
                    assert torch.count_nonzero(a.b) == 0
        eng.load_adapters(adapters)
        got = _velocity(eng, b)
        ref_mbs = [dict(latents=noised(b), sigma=b["sigma"], encoder_hidden_states=b["encoder_hidden_states"],
                        pooled_projections=b["pooled_projections"])]
        off = torch.cat(BaseReference(eng).forward_backward(ref_mbs, None, forward_only=True))
        assert (got - expected).abs().max() <= 1e-5
        assert (got - fresh).abs().max() > 1e-2  # the adapters matter
        assert (fresh - expected_base).abs().max() <= 1e-5
        assert torch.equal(off, fresh)  # B = 0 adds exactly nothing: bit-equal to the adapters switched off
        chunk = eng.chunks[0]
        trainable = [n for n, p in chunk.named_parameters() if p.requires_grad]
        assert trainable and all(n.endswith((".lora.a", ".lora.b")) for n in trainable)
        names = {n for n, _ in eng.iter_full_adapters()}
        assert names == set(adapters)
    finally:
        destroy_distributed()


@pytest.mark.slow
@pytest.mark.dist
def test_lora_parallel_matches_peft(tmp_path):
    torch.set_num_threads(1)
    model, base, adapters = lora_workers.peft_model(DCFG)
    batches = tiny.sft_batches(DCFG, num_microbatches=2, batch=2, context_len=6, seed=2)
    loss, grads = lora_workers.peft_sft_reference(model, batches)
    torch.save(dict(dcfg=DCFG, base=base, adapters=adapters, batches=batches), tmp_path / "case.pt")
    out = run_multiprocess(lora_workers.parity_rank, 2, str(tmp_path / "case.pt"), timeout_s=600)
    scale = max(float(g.abs().max()) for g in grads.values())
    for rank, r in enumerate(out):
        for label, res in r.items():
            if res["loss"] is not None:
                assert abs(res["loss"] - loss) <= 1e-6, (label, res["loss"], loss)
            assert set(res["grads"]) == set(grads), label
            err = max(float((res["grads"][k] - g).abs().max()) for k, g in grads.items())
            assert err <= 1e-5 * scale, (label, rank, err, scale)
            assert res["trainable"] == ["lora"], (label, res["trainable"])
            assert res["in_optimizer"] == res["adapter_numel"] == res["in_ddp"], label


def test_plan_counts_the_lora_models_adapters():
    """``megaflow plan``'s adapter count (plan_model.lora_params, summed over blocks) equals the trainable
    parameters of megaflow's LoRA DiT (tiny SD3 without a second attention; TP=1). Needs: CPU, 1 process."""
    from megaflow.plan.dit import dims_from_config, lora_params
    from megaflow.models.common.lora import TARGETS
    dcfg = tiny.tiny_config(qk_norm="rms_norm", dual_attention_layers=())
    eng = lora_workers.lora_engine(dcfg, ParallelDims(), optimizer=False)
    try:
        trained = sum(p.numel() for c in eng.chunks for p in c.parameters() if p.requires_grad)
    finally:
        destroy_distributed()
    d = dims_from_config("sd3", dcfg, "tiny")
    assert sum(lora_params(d, i, lora_workers.RANK, TARGETS) for i in range(d.num_blocks)) == trained
