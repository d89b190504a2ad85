"""GPU checks of the embedded SGLang engine on tiny offline pipelines.

Invariant: every engine here runs without sgl_kernel (torch SDPA, SGLang's native RMSNorm); the stand-in raises
on any kernel use, so a check that finishes used none. Design notes: docs/design/testing.md.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from megaflow.families import DEFAULT_FAMILY
from megaflow.testing.gpu.common import require_cuda, require_module

TOLERANCE = {"fp32": 1e-5}
"""Largest |rollout - trainer| log-prob relative to max |log-prob| that passes (bf16 is reported only)."""
SERVER_KWARGS = {"attention_backend": "torch_sdpa"}
ENGINE_ENV = {"SGLANG_ENABLE_DETERMINISTIC_INFERENCE": "1"}
"""SGLang's native RMSNorm (else bf16 RMSNorm calls sgl_kernel); read by the workers at model build."""
STEPS = 4


def _needs() -> None:
    require_cuda()
    require_module("sglang")
    require_module("megatron.core")


def tiny_pipeline(family: str, root: Path) -> Path:
    from megaflow.models.tiny_pipeline import make_tiny_pipeline

    return make_tiny_pipeline(family, root / f"tiny-{family}", seed=0)


def start_engine(path: Path, family: str = DEFAULT_FAMILY, precision: str = "fp32", engine_id: str = "gpu0"):
    """An SGLang engine on the sgl_kernel-free path (``SERVER_KWARGS``, ``ENGINE_ENV``)."""
    import megaflow  # noqa: F401
    from megaflow.rollout.sglang import SGLangEngine, SGLangEngineConfig

    os.environ.update(ENGINE_ENV)
    return SGLangEngine(SGLangEngineConfig(model_path=str(path), family=family, precision=precision,
                                           engine_id=engine_id, server_kwargs=dict(SERVER_KWARGS)))


def rollout(engine, steps: int = STEPS, seed: int = 5):
    from megaflow.rollout.types import RolloutRequest

    return engine.generate([RolloutRequest(prompt="a red cat", num_outputs=4, seed=seed, num_steps=steps,
                                           return_model_outputs=True)])


def logprob_errors(rollout_lp, trainer_lp) -> dict:
    """max |rollout - trainer| and that relative to max |rollout| (the log-probs of every step of every sample)."""
    err = float((rollout_lp.double() - trainer_lp.double()).abs().max())
    ref = float(rollout_lp.double().abs().max())
    return {"max_abs": err, "rel": err / max(ref, 1e-30), "max_abs_log_prob": ref}


def flow_log_probs(t, velocities):
    """log p(x_{t+1} | x_t) of every step of trajectory ``t`` under ``velocities`` [T, ...] (megaflow's flow math)."""
    import torch

    from megaflow.flow.step import config_for_step, sigma_max_of, transition_log_prob
    from megaflow.testing.reference import sde_step_indices, transition_config

    config, window = transition_config(t), sde_step_indices(t)
    lat, v = t.latents.float(), velocities.float().to(t.latents.device)
    return torch.stack([transition_log_prob(lat[i:i + 1], v[i:i + 1], lat[i + 1:i + 2], t.sigmas[i], t.sigmas[i + 1],
                                            sigma_max=sigma_max_of(t.sigmas),
                                            config=config_for_step(config, i, window)).log_prob[0]
                        for i in range(t.num_steps)])


def trainer_velocities(trainer, t, dev):
    """The trainer DiT's velocity at every step of trajectory ``t`` (its own conditioning), on ``dev``."""
    import torch

    c = t.conditioning
    ehs, pooled = c["encoder_hidden_states"].float().to(dev)[None], c["pooled_projections"].float().to(dev)[None]
    return torch.cat([trainer.velocity(t.latents[i:i + 1].float().to(dev), t.sigmas[i:i + 1].float().to(dev), ehs,
                                       pooled) for i in range(t.num_steps)]).cpu()


def _reference_trainer(path: Path):
    """megaflow's forward-only megatron DiT (fp32, local spec) holding the pipeline's transformer weights."""
    from diffusers import SD3Transformer2DModel

    from megaflow.models.registry import get_family
    from megaflow.trainer.runner import ReferenceModel

    dit = SD3Transformer2DModel.from_pretrained(path / "transformer")
    model = ReferenceModel(get_family("sd3").config_from_diffusers(dict(dit.config)), family="sd3", spec="local")
    model.load_diffusers_state_dict(dit.state_dict())
    return model


def sd3_logprobs_body(dev, root: Path, precisions=("fp32", "bf16")) -> dict:
    """``engine_sd3``'s body on ``dev`` (engines of ``precisions`` one after the other, one trainer)."""
    import torch

    import megaflow  # noqa: F401
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import destroy_distributed, init_distributed

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    path, out = tiny_pipeline("sd3", root), {}
    init_distributed(ParallelDims(), seed=0)
    try:
        trainer = _reference_trainer(path)
        for precision in precisions:
            t0 = time.perf_counter()
            engine = start_engine(path, precision=precision, engine_id=f"sd3-{precision}")
            try:
                start_s, t1 = time.perf_counter() - t0, time.perf_counter()
                trajs = rollout(engine)
                gen_s = time.perf_counter() - t1
            finally:
                engine.shutdown()
            trainer_lp = torch.stack([flow_log_probs(t, trainer_velocities(trainer, t, dev)) for t in trajs])
            rollout_lp = torch.stack([t.log_probs for t in trajs]).float()
            v_err = max(float((trainer_velocities(trainer, t, dev) - t.model_outputs.float()).abs().max())
                        for t in trajs)
            out[precision] = {**logprob_errors(rollout_lp, trainer_lp), "velocity_max_abs": v_err,
                              "finite": bool(torch.isfinite(rollout_lp).all()), "engine_start_s": round(start_s, 2),
                              "generate_s": round(gen_s, 3), "samples": len(trajs), "steps": STEPS}
    finally:
        destroy_distributed()
    return sd3_record(out)


def sd3_record(out: dict) -> dict:
    """pass: fp32 within ``TOLERANCE["fp32"]`` and every precision finite (bf16's error is reported)."""
    fp32 = out.get("fp32")
    ok = fp32 is not None and fp32["rel"] <= TOLERANCE["fp32"] and all(r["finite"] for r in out.values())
    head = ", ".join(f"{p} rel {r['rel']:.2e}" for p, r in out.items())
    return {"status": "pass" if ok else "fail", "tolerance": TOLERANCE, **out,
            "headline": f"rollout vs trainer log-probs: {head} (fp32 tol {TOLERANCE['fp32']:g}; bf16 reported)"}


def engine_sd3() -> dict:
    _needs()
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        return sd3_logprobs_body(torch.device("cuda", 0), Path(tmp))


def engine_sync() -> dict:
    """Colocated sync of CUDA tensors into the engine (CUDA IPC), verified."""
    _needs()
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        return sync_body(torch.device("cuda", 0), Path(tmp))


def sync_body(dev, root: Path, pushes: int = 4) -> dict:
    """``engine_sync``'s body: the tiny SD3 DiT's weights + noise, on ``dev``, through ``SharedMemoryBridge`` (CUDA IPC
    on a GPU, shared memory on CPU: the CPU test runs it), ``pushes`` times: the first push and the steady ones apart,
    against a copy of the same bytes on ``dev``."""
    import torch

    from megaflow.bridge.shared_memory import SharedMemoryBridge
    from megaflow.checksum import WSUM
    from megaflow.testing.gpu.pushes import copy_seconds, push_record
    from megaflow.testing.reference import ReferenceSampler
    from megaflow.rollout.sglang import weights_checksum

    path = tiny_pipeline("sd3", root)
    engine = start_engine(path)
    try:
        before = rollout(engine)
        gen = torch.Generator().manual_seed(0)
        state = [(n, (p + 0.05 * torch.randn(p.shape, generator=gen)).to(dev))
                 for n, p in ReferenceSampler(path).transformer.state_dict().items()]
        bridge = SharedMemoryBridge([engine], bucket_bytes=1 << 20, verify=True)
        reports = [bridge.push(state) for _ in range(pushes)]
        report = reports[-1]
        same_checksum = engine.checksum() == weights_checksum([(n, t.cpu()) for n, t in state])
        after = rollout(engine)
    finally:
        engine.shutdown()
    changed = float(max((a.image - b.image).abs().max() for a, b in zip(after, before)))
    on_device = all(d.startswith(WSUM) for d in report.expected_digests.values())
    verified = all(r.verified for r in reports)
    ok = verified and same_checksum and changed > 1e-3 and (dev.type != "cuda" or on_device)
    timing = push_record([r.seconds for r in reports], report.num_bytes, copy_seconds(report.num_bytes, dev))
    return {"status": "pass" if ok else "fail", "device": str(dev), "verified": verified,
            "message": report.message, "tensors": report.num_tensors, "buckets": report.num_buckets,
            "mbytes": round(report.num_bytes / 2**20, 2), "push_s": round(report.seconds, 4), **timing,
            "digests_on_device": on_device, "checksum_is_pushed_weights": same_checksum, "image_change_max": changed,
            "headline": f"{report.num_buckets} {dev.type} buckets verified={verified}, checksum match "
                        f"{same_checksum}, images changed by {changed:.3f}; first push {timing['first_push_s']} s, "
                        f"steady {timing['push_gb_per_s']} GB/s vs copy {timing['copy_gb_per_s']} GB/s"}


def _device_used() -> int:
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def engine_release() -> dict:
    """Release / resume: device memory freed and regained; the same images after resume."""
    _needs()
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_pipeline("sd3", Path(tmp))
        weights = sum(p.stat().st_size for p in path.rglob("*.safetensors"))
        torch.cuda.init()
        engine = start_engine(path)
        try:
            before = rollout(engine)
            awake = _device_used()
            t0 = time.perf_counter()
            engine.release()
            release_s, asleep = time.perf_counter() - t0, _device_used()
            t0 = time.perf_counter()
            engine.resume()
            resume_s, back = time.perf_counter() - t0, _device_used()
            after = rollout(engine)
        finally:
            engine.shutdown()
    return release_record(weights, awake, asleep, back, release_s, resume_s,
                          same=all(torch.equal(a.image, b.image) for a, b in zip(after, before)))


def release_record(weights: int, awake: int, asleep: int, back: int, release_s: float, resume_s: float, *,
                   same: bool) -> dict:
    """pass: the release frees at least 90% of the pipeline's weight bytes, the resume takes them back, and the
    images after resume are the ones before."""
    freed, regained = awake - asleep, back - asleep
    ok = freed >= 0.9 * weights and regained >= 0.9 * weights and same
    mib = 2**20
    return {"status": "pass" if ok else "fail", "weights_mib": weights / mib, "used_awake_mib": awake / mib,
            "used_released_mib": asleep / mib, "used_resumed_mib": back / mib, "freed_mib": freed / mib,
            "regained_mib": regained / mib, "release_s": round(release_s, 3), "resume_s": round(resume_s, 3),
            "same_images_after_resume": same,
            "headline": f"freed {freed / mib:.1f} MiB, regained {regained / mib:.1f} MiB (weights "
                        f"{weights / mib:.1f} MiB), release {release_s:.2f} s, resume {resume_s:.2f} s, "
                        f"same images {same}"}


def engine_flux() -> dict:
    """A tiny FLUX.1 engine in bf16: finite trajectories; log-probs recomputed from its velocities."""
    _needs()
    with tempfile.TemporaryDirectory() as tmp:
        return flux_body(Path(tmp), "bf16")


def flux_body(root: Path, precision: str) -> dict:
    """``engine_flux``'s body (the CPU test runs it in fp32): pass when every trajectory is finite and its log-probs
    are those of megaflow's flow math on its own velocities within 2e-2 relative (bf16's tolerance)."""
    import torch

    engine = start_engine(tiny_pipeline("flux", root), family="flux", precision=precision)
    try:
        t0 = time.perf_counter()
        trajs = rollout(engine)
        gen_s = time.perf_counter() - t0
    finally:
        engine.shutdown()
    rollout_lp = torch.stack([t.log_probs for t in trajs]).float()
    recomputed = torch.stack([flow_log_probs(t, t.model_outputs) for t in trajs])
    errors = logprob_errors(rollout_lp, recomputed)
    finite = all(bool(torch.isfinite(t.latents).all() and torch.isfinite(t.log_probs).all()) for t in trajs)
    ok = finite and errors["rel"] <= 2e-2
    return {"status": "pass" if ok else "fail", "precision": precision, "finite": finite, **errors,
            "generate_s": round(gen_s, 3), "samples": len(trajs), "latent_shape": list(trajs[0].latents.shape),
            "headline": f"{precision} FLUX: finite {finite}, log-probs vs flow math on its velocities rel "
                        f"{errors['rel']:.2e} (tol 2e-2)"}
