"""``megaflow bench train``: one SFT training step of the megatron SD3 MMDiT vs the same step in
diffusers, on CPU at TP=1 with identical weights and batches.

A step = forward + backward + optimizer update (Adam, lr 1e-4, grad clip 1.0) over ``microbatches``
microbatches of ``batch`` samples (rectified-flow loss). megatron side: ``TrainEngine.train_step``
(megatron schedule, DDP grad buffers, finalize_model_grads, megatron optimizer); diffusers side:
``SD3Transformer2DModel`` + ``torch.optim.AdamW`` (foreach) + ``clip_grad_norm_``.

Timing: ``warmup`` untimed steps each, then ``repeats`` rounds alternating megatron / diffusers
(shared-machine load hits both alike); per-step time = median over rounds (``ratio``);
``ratio_min`` compares the fastest rounds, the least load-disturbed estimate. ``max_abs_diff`` is the
largest velocity difference of the two models on the first microbatch at the common initial
weights; ``loss_diff`` the largest difference of the per-step losses while both train.

    megaflow bench train --json
"""
from __future__ import annotations

import os
import statistics
import time

import torch

from megaflow.models.sd3 import tiny


def _default_config() -> dict:
    return tiny.tiny_config(num_layers=2, num_attention_heads=4, attention_head_dim=32,
                            caption_projection_dim=128, joint_attention_dim=64,
                            pooled_projection_dim=32, sample_size=16, pos_embed_max_size=16)


def _diffusers_step(model, opt, batches) -> float:
    opt.zero_grad(set_to_none=True)
    loss, _ = _diffusers_loss_backward(model, batches)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


def _diffusers_loss_backward(model, batches):
    total = 0.0
    for b in batches:
        v = tiny.diffusers_velocity(model, b["latents"], b["sigma"], b["encoder_hidden_states"], b["pooled_projections"])
        loss = torch.nn.functional.mse_loss(v, b["target"]) / len(batches)
        loss.backward()
        total += float(loss)
    return total, None


def bench_train(*, batch: int = 8, microbatches: int = 1, context_len: int = 16, warmup: int = 3,
                repeats: int = 10, distributed_optimizer: bool = False, threads: int = 1,
                spec: str = "local", seed: int = 0, **config_overrides) -> dict:
    """Time megatron vs diffusers SFT steps; returns a JSON-able dict (see module docstring).

    ``config_overrides`` are diffusers SD3 config keys (e.g. num_layers=4, attention_head_dim=64)."""
    import megaflow  # noqa: F401  (import guards before megatron)
    from megaflow.models.sd3 import from_diffusers
    from megaflow.parallel import ParallelDims, destroy_distributed, init_distributed
    from megaflow.trainer.engine import TrainEngine, adam_config, rectified_flow_microbatch

    torch.set_num_threads(threads)
    dcfg = {**_default_config(), **config_overrides}
    raw = tiny.sft_batches(dcfg, num_microbatches=microbatches, batch=batch, context_len=context_len, seed=seed + 1)
    mbs = [rectified_flow_microbatch(b["x0"], b["noise"], b["sigma"], b["encoder_hidden_states"],
                                     b["pooled_projections"]) for b in raw]
    ref = tiny.diffusers_model(dcfg, seed=seed).train()
    init_state = {k: v.clone() for k, v in ref.state_dict().items()}

    init_distributed(ParallelDims(), seed=seed)
    try:
        eng = TrainEngine(from_diffusers(dcfg), spec=spec,
                          optimizer_config=adam_config(lr=1e-4, grad_clip=1.0, distributed=distributed_optimizer))
        eng.load_diffusers_state_dict(init_state)
        with torch.no_grad():
            m0 = mbs[0]
            v_mg = eng.velocity(m0["latents"], m0["sigma"], m0["encoder_hidden_states"], m0["pooled_projections"])
            v_df = tiny.diffusers_velocity(ref, m0["latents"], m0["sigma"], m0["encoder_hidden_states"], m0["pooled_projections"])
        max_abs_diff = float((v_mg - v_df).abs().max())
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, weight_decay=0.0, foreach=True)

        mg_times, df_times, losses = [], [], []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            mg_loss = float(eng.train_step(mbs)["loss"])
            t1 = time.perf_counter()
            df_loss = _diffusers_step(ref, opt, mbs)
            t2 = time.perf_counter()
            losses.append(abs(mg_loss - df_loss))
            if i >= warmup:
                mg_times.append(t1 - t0)
                df_times.append(t2 - t1)
    finally:
        destroy_distributed()
    mg_ms, df_ms = 1e3 * statistics.median(mg_times), 1e3 * statistics.median(df_times)
    return {
        "megatron_ms": round(mg_ms, 3), "diffusers_ms": round(df_ms, 3), "ratio": round(mg_ms / df_ms, 4),
        "ratio_min": round(min(mg_times) / min(df_times), 4),  # best-of-N: least disturbed by load
        "max_abs_diff": max_abs_diff, "loss_diff": max(losses),
        "megatron_ms_all": [round(1e3 * t, 3) for t in mg_times], "diffusers_ms_all": [round(1e3 * t, 3) for t in df_times],
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dcfg.items()},
        "batch": batch, "microbatches": microbatches, "context_len": context_len, "threads": threads,
        "distributed_optimizer": distributed_optimizer, "spec": spec,
        "params": sum(p.numel() for p in ref.parameters()),
        "loadavg_1m": os.getloadavg()[0],
    }


if __name__ == "__main__":
    import json

    print(json.dumps(bench_train(), indent=2))
