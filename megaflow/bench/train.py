"""``megaflow bench train``: one SFT step of the megatron SD3 MMDiT vs the same step in diffusers (CPU, TP=1).
Design notes: docs/design/bench.md.
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


def _timed(step) -> tuple[float, float]:
    """(step's return value, wall seconds it took)."""
    t0 = time.perf_counter()
    value = step()
    return value, time.perf_counter() - t0


def _time_rounds(sides: dict, *, warmup: int, repeats: int) -> tuple[dict[str, list[float]], float]:
    """Run every side once per round, in rotating order; per side the timed seconds of the rounds
    after ``warmup``, and the largest megatron vs diffusers loss difference over all rounds."""
    times = {k: [] for k in sides}
    loss_diff = 0.0
    for i in range(warmup + repeats):
        loss = {}
        for name in list(sides)[i % len(sides):] + list(sides)[:i % len(sides)]:
            loss[name], seconds = sides[name]()
            if i >= warmup:
                times[name].append(seconds)
        loss_diff = max(loss_diff, abs(loss["megatron"] - loss["diffusers"]))
    return times, loss_diff


def _ratios(times: dict[str, list[float]]) -> dict:
    """Median ms per side; median and best-of-N (least load-disturbed) ratios to diffusers."""
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    out = {}
    for side, tag in (("megatron", ""), ("megatron_plain", "_plain")):
        if side in times:
            out.update({f"{side}_ms": round(ms[side], 3), f"ratio{tag}": round(ms[side] / ms["diffusers"], 4),
                        f"ratio{tag}_min": round(min(times[side]) / min(times["diffusers"]), 4)})
    out["diffusers_ms"] = round(ms["diffusers"], 3)
    return out


def bench_train(*, batch: int = 8, microbatches: int = 1, context_len: int = 16, warmup: int = 3,
                repeats: int = 10, distributed_optimizer: bool = False, threads: int = 1,
                spec: str = "local", seed: int = 0, plain: bool = True, **config_overrides) -> dict:
    """Time megatron vs diffusers SFT steps; returns a JSON-able dict (see the module's design notes).

    ``config_overrides`` are diffusers SD3 config keys (e.g. num_layers=4, attention_head_dim=64)."""
    import megaflow  # noqa: F401  (import guards before megatron)
    from megaflow.models.sd3 import from_diffusers
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import destroy_distributed, init_distributed
    from megaflow.parallel.perf_patches import apply_perf_patches, remove_perf_patches
    from megaflow.trainer.runner import FastPaths, Trainer, adam_config, rectified_flow_microbatch

    torch.set_num_threads(threads)
    dcfg = {**_default_config(), **config_overrides}
    raw = tiny.sft_batches(dcfg, num_microbatches=microbatches, batch=batch, context_len=context_len, seed=seed + 1)
    mbs = [rectified_flow_microbatch(b["x0"], b["noise"], b["sigma"], b["encoder_hidden_states"],
                                     b["pooled_projections"]) for b in raw]
    ref = tiny.diffusers_model(dcfg, seed=seed).train()
    init_state = {k: v.clone() for k, v in ref.state_dict().items()}

    def new_trainer(fast_paths=None):
        trainer = Trainer(from_diffusers(dcfg), spec=spec, fast_paths=fast_paths,
                          optimizer_config=adam_config(lr=1e-4, grad_clip=1.0, distributed=distributed_optimizer))
        trainer.load_diffusers_state_dict(init_state)
        return trainer

    init_distributed(ParallelDims(), seed=seed)
    try:
        megatron = new_trainer()
        megatron_plain = new_trainer(FastPaths(single_rank_grads=False, single_rank_finalize=False,
                                               joint_adam_groups=False, megatron_patches=frozenset())) if plain else None
        with torch.no_grad():
            m0 = mbs[0]
            v_mg = megatron.velocity(m0["latents"], m0["sigma"], m0["encoder_hidden_states"], m0["pooled_projections"])
            v_df = tiny.diffusers_velocity(ref, m0["latents"], m0["sigma"], m0["encoder_hidden_states"], m0["pooled_projections"])
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, weight_decay=0.0, foreach=True)

        def plain_step():  # megatron's own code: the process-wide patches are off while it runs
            remove_perf_patches()
            try:
                return _timed(lambda: float(megatron_plain.train_step(mbs)["loss"]))
            finally:
                apply_perf_patches()

        sides = {"megatron": lambda: _timed(lambda: float(megatron.train_step(mbs)["loss"])),
                 "diffusers": lambda: _timed(lambda: _diffusers_step(ref, opt, mbs))}
        if plain:
            sides["megatron_plain"] = plain_step
        times, loss_diff = _time_rounds(sides, warmup=warmup, repeats=repeats)
        extra = {"fast_paths": megatron.fast_paths_active}
        if plain:  # both megatron sides took the same steps: the fast paths must not change a bit
            fast_w, plain_w = dict(megatron.iter_full_params()), dict(megatron_plain.iter_full_params())
            extra["fast_paths_bit_identical"] = all(torch.equal(fast_w[k], plain_w[k]) for k in fast_w)
    finally:
        destroy_distributed()
    return {
        **_ratios(times), **extra, "max_abs_diff": float((v_mg - v_df).abs().max()), "loss_diff": loss_diff,
        **{f"{k}_ms_all": [round(1e3 * t, 3) for t in v] for k, v in times.items()},
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dcfg.items()},
        "batch": batch, "microbatches": microbatches, "context_len": context_len, "threads": threads,
        "distributed_optimizer": distributed_optimizer, "spec": spec,
        "params": sum(p.numel() for p in ref.parameters()),
        "loadavg_1m": os.getloadavg()[0],
    }


if __name__ == "__main__":
    import json

    print(json.dumps(bench_train(), indent=2))
