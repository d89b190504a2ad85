"""GPU checks of the megatron DiT. Design notes: docs/design/testing.md."""
from __future__ import annotations

import copy
import statistics
import time

from megaflow.families import DEFAULT_FAMILY, card, family_names
from megaflow.testing.gpu.common import Skip, rel_err, require_cuda, require_module

TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}
"""Largest velocity error relative to max |diffusers velocity| that passes."""
RATIO_BOUNDS = (0.6, 1.6)
"""measured / predicted trainer memory that passes (tests/plan/test_plan.py's bounds on CPU)."""
SETTINGS = {name: [f"model.family={name}", *card(name).gpu_check_settings] for name in family_names()}
"""``--set`` overrides of each family's step check (its card's ``gpu_check_settings``): 512 px, batch 1, no KL
reference (docs/design/testing.md)."""
STEPS, WARMUP = 5, 2


def _parity_config() -> dict:
    from megaflow.models.sd3 import tiny

    return tiny.tiny_config(qk_norm="rms_norm", dual_attention_layers=(1,), attention_head_dim=16,
                            num_attention_heads=4, caption_projection_dim=64)


def _velocity_errors(impl: str, dev) -> dict:
    """Per dtype: megaflow's velocity vs diffusers' on ``dev`` (same weights, same inputs)."""
    import torch

    from megaflow.models.common.tiny import noised
    from megaflow.models.registry import get_family
    from megaflow.models.sd3 import tiny
    from megaflow.trainer.runner import ReferenceModel

    dcfg = _parity_config()
    ref_cpu = tiny.diffusers_model(dcfg, seed=0)
    state = ref_cpu.state_dict()
    b = tiny.sft_batches(dcfg, num_microbatches=1, batch=2, context_len=8, seed=1)[0]
    x, sigma = noised(b).to(dev), b["sigma"].to(dev)
    ehs, pooled = b["encoder_hidden_states"].to(dev), b["pooled_projections"].to(dev)
    out, fp32_ref = {}, None
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        kwargs = {} if dtype == torch.float32 else {"bf16": True, "params_dtype": torch.bfloat16}
        engine = ReferenceModel(get_family("sd3").config_from_diffusers(dcfg, **kwargs), family="sd3", spec=impl)
        engine.load_diffusers_state_dict(state)
        got = engine.velocity(x, sigma, ehs, pooled)
        ref_model = copy.deepcopy(ref_cpu).to(device=dev, dtype=dtype)
        with torch.no_grad():
            ref = tiny.diffusers_velocity(ref_model, x.to(dtype), sigma, ehs.to(dtype), pooled.to(dtype))
        fp32_ref = ref if fp32_ref is None else fp32_ref
        err, rel = rel_err(got, ref)
        out[name] = {"max_abs": err, "rel": rel, "tol": TOLERANCE[name], "ok": rel <= TOLERANCE[name],
                     "rel_vs_fp32_diffusers": rel_err(got, fp32_ref)[1], "ref_max_abs": float(ref.float().abs().max())}
        del engine, ref_model
    return out


def _parity(impl: str) -> dict:
    require_cuda()
    require_module("megatron.core")
    require_module("diffusers")
    import torch

    return velocity_parity(impl, torch.device("cuda", 0))


def velocity_parity(impl: str, dev) -> dict:
    """``parity_*``'s body on any device (the CPU test runs it with the local spec)."""
    import torch

    import megaflow  # noqa: F401  (import guards before megatron)
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import destroy_distributed, init_distributed

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity: no TF32 in GEMMs or the patch conv
    torch.backends.cudnn.allow_tf32 = False
    init_distributed(ParallelDims(), seed=0)
    try:
        errors = _velocity_errors(impl, dev)
    finally:
        destroy_distributed()
    ok = all(e["ok"] for e in errors.values())
    head = ", ".join(f"{k} rel {v['rel']:.2e} (tol {v['tol']:g})" for k, v in errors.items())
    return {"status": "pass" if ok else "fail", "spec": impl, "config": _parity_config(), **errors, "headline": head}


def parity_local() -> dict:
    """megatron local spec (torch SDPA, megatron's own linears) vs diffusers on CUDA."""
    return _parity("local")


def parity_te() -> dict:
    """Transformer Engine spec vs diffusers on CUDA (skipped where transformer_engine does not import)."""
    require_module("transformer_engine")
    from megaflow.models.common.spec import HAVE_TE

    if not HAVE_TE:
        raise Skip("megatron.core.extensions.transformer_engine.HAVE_TE is False")
    return _parity("te")


def predicted(recompute: str, family: str = DEFAULT_FAMILY) -> dict:
    """``megaflow plan``'s trainer items (bytes) for ``SETTINGS[family]`` + ``train.recompute``, the family's
    built-in dims, 1 GPU. Standard library + megaflow config only (no torch), so the CPU test calls it too."""
    from megaflow.config import load_config
    from megaflow.plan.dit import dims_from_config
    from megaflow.plan.memory import token_counts, trainer_items

    cfg = load_config(None, [*SETTINGS[family], f"train.recompute={recompute}"])
    source, conf = card(family).builtin
    dims = dims_from_config(family, conf, source)
    image, text = token_counts(cfg, dims)
    items, info = trainer_items(cfg, dims, world=1, stage=0, image=image, text=text)
    step = sum(v for k, v in items.items() if k not in ("runtime", "GRPO microbatches (1 step)"))
    return {"items": items, "info": info, "train_step_bytes": step, "image_tokens": image, "text_tokens": text}


def _trainer(recompute: str, conf: dict, family: str = DEFAULT_FAMILY):
    """(Trainer, megaflow config) of the step check for diffusers config ``conf``, random weights."""
    from megaflow.config import load_config
    from megaflow.models.registry import get_family
    from megaflow.trainer.runner import Trainer
    from megaflow.trainer.settings import lora_settings, optimizer_config, transformer_kwargs

    cfg = load_config(None, [*SETTINGS[family], f"train.recompute={recompute}"])
    mcfg = get_family(family).config_from_diffusers(dict(conf), **transformer_kwargs(cfg))
    return Trainer(mcfg, family=family, spec=cfg.model.spec, optimizer_config=optimizer_config(cfg),
                   lora=lora_settings(cfg)), cfg


def _microbatch(conf: dict, image_tokens: int, text_tokens: int, dev, family: str = DEFAULT_FAMILY) -> dict:
    """One random rectified-flow microbatch of the family's input layout (its ``tiny.check_latent_shape`` and
    ``check_inputs``: SD3 latent images; FLUX packed tokens with their position ids and the guidance input)."""
    import torch

    from megaflow.models.registry import get_family
    from megaflow.trainer.runner import rectified_flow_microbatch

    tiny = get_family(family).tiny
    g = torch.Generator(device=dev).manual_seed(0)
    shape = tiny.check_latent_shape(conf, image_tokens)
    x0, noise = (torch.randn(*shape, device=dev, generator=g) for _ in range(2))
    ehs = torch.randn(1, text_tokens, conf["joint_attention_dim"], device=dev, generator=g, dtype=torch.bfloat16)
    pooled = torch.randn(1, conf["pooled_projection_dim"], device=dev, generator=g, dtype=torch.bfloat16)
    mb = rectified_flow_microbatch(x0, noise, torch.full((1,), 0.5, device=dev), ehs, pooled)
    mb.update(tiny.check_inputs(image_tokens, text_tokens, dev))
    return mb


def _step(recompute: str, family: str = DEFAULT_FAMILY) -> dict:
    require_cuda()
    require_module("megatron.core")
    import torch

    return measure_step(recompute, torch.device("cuda", 0), family=family)


def measure_step(recompute: str, dev, conf: dict | None = None, steps: int = STEPS, family: str = DEFAULT_FAMILY) -> dict:
    """The step check's body: ``conf`` (default: the family's built-in table in megaflow plan) on ``dev``; memory
    figures are CUDA's (0 on CPU, where the CPU test runs a tiny ``conf`` through the same path)."""
    import torch

    import megaflow  # noqa: F401
    from megaflow.models.common.spec import resolve_impl
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import destroy_distributed, init_distributed
    conf, cuda = conf or card(family).builtin[1], dev.type == "cuda"
    mem = (lambda: torch.cuda.memory_allocated()) if cuda else (lambda: 0)
    peak = (lambda: torch.cuda.max_memory_allocated()) if cuda else (lambda: 0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    plan = predicted(recompute, family)
    init_distributed(ParallelDims(), seed=0)
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        trainer, cfg = _trainer(recompute, conf, family)
        build_s, built = time.perf_counter() - t0, mem()
        mb = _microbatch(conf, plan["image_tokens"], plan["text_tokens"], dev, family)
        times, losses, steady, peak_before = [], [], 0, 0
        for i in range(WARMUP + steps):
            if i == WARMUP:  # optimizer states exist now: what a step adds on top is activations + temporaries
                steady, peak_before = mem(), peak()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
            sync()
            t = time.perf_counter()
            losses.append(float(trainer.train_step([mb])["loss"]))
            sync()
            times.append(time.perf_counter() - t)
        step_peak = peak()
        phases = _phase_peaks(trainer, mb, steady, peak, sync, cuda)
        params = sum(p.numel() for c in trainer.chunks for p in c.parameters())
        trained = sum(p.numel() for c in trainer.chunks for p in c.parameters() if p.requires_grad)
        spec = resolve_impl(cfg.model.spec)
    finally:
        destroy_distributed()
    return _step_record(recompute, plan, spec=spec, params=params, trained=trained, build_s=build_s, built=built, steady=steady,
                        peak=max(peak_before, step_peak), step_peak=step_peak, times=times[WARMUP:], losses=losses,
                        phases=phases)


def _phase_peaks(trainer, mb: dict, steady: int, peak, sync, cuda: bool) -> dict:
    """One more step, its two halves measured apart: forward + backward (activations, which recompute
    shrinks) and the optimizer step (its temporaries); GiB over the steady state."""
    import torch

    from megaflow.trainer.runner import rectified_flow_loss

    def over() -> float:
        sync()
        return (peak() - steady) / 2**30

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.optimizer.zero_grad()
    trainer.forward_backward([mb], rectified_flow_loss)
    fwd_bwd = over()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.optimizer.step()
    return {"forward_backward": fwd_bwd, "optimizer_step": over()}


def _step_record(recompute: str, plan: dict, *, spec, params, trained, build_s, built, steady, peak, step_peak, times,
                 losses, phases: dict) -> dict:
    gib = 2**30
    act_pred = plan["items"]["activations"]
    ratio = peak / plan["train_step_bytes"]
    ratio_act = phases["forward_backward"] * gib / act_pred  # the activations live in forward + backward only
    finite = all(loss == loss and abs(loss) < float("inf") for loss in losses)
    ok = finite and RATIO_BOUNDS[0] <= ratio <= RATIO_BOUNDS[1]
    median = statistics.median(times)
    return {
        "status": "pass" if ok else "fail", "recompute": recompute, "spec": spec, "params": params, "trained_params": trained,
        "tokens": {"image": plan["image_tokens"], "text": plan["text_tokens"], "batch": 1},
        "build_s": round(build_s, 2), "step_s_median": round(median, 4), "step_s_all": [round(t, 4) for t in times],
        "losses": losses, "measured_gib": {"after_build": built / gib, "steady_before_step": steady / gib,
                                           "peak_total": peak / gib, "step_peak_over_steady": (step_peak - steady) / gib},
        "predicted_gib": {k: v / gib for k, v in plan["items"].items()},
        "predicted_info_gib": {k: v / gib for k, v in plan["info"].items()},
        "predicted_train_step_gib": plan["train_step_bytes"] / gib,
        "ratio_peak_vs_predicted": round(ratio, 3), "ratio_activations_vs_predicted": round(ratio_act, 3),
        "ratio_bounds": RATIO_BOUNDS, "losses_finite": finite, "phase_peak_over_steady_gib": phases,
        "headline": f"step {median * 1000:.0f} ms, peak {peak / gib:.1f} GiB vs predicted "
                    f"{plan['train_step_bytes'] / gib:.1f} (x{ratio:.2f}), activations x{ratio_act:.2f}",
    }


def step_recompute_none() -> dict:
    """SD3.5-M train step, every block keeps its activations."""
    return _step("none")


def step_recompute_full() -> dict:
    """SD3.5-M train step, every block recomputed in backward (train.recompute = full)."""
    return _step("full")


def step_flux_lora() -> dict:
    """FLUX.1-dev-shaped train step, LoRA rank 32 on the frozen bf16 base (SETTINGS["flux"])."""
    return _step("none", "flux")
