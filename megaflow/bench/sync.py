"""``megaflow bench sync``: weight-sync seconds into SGLang engines vs a plain copy of the same bytes, on a
scaled-up SD3 DiT (``--params N``: SD3-like shapes of about N parameters, or ``layers`` x ``heads`` x ``head_dim``) and
the ``tiny`` one, with the bytes/s of each phase (gather, convert, pack, digest, push, verify). Design notes:
docs/design/bench.md.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from megaflow.bench.sync_phases import Source, phase_seconds, time_rounds, trainer_phases

__all__ = ["bench_sync", "make_large_pipeline", "shape_for_params"]


def _dit_config(out: Path, *, layers: int, heads: int, head_dim: int) -> dict:
    from diffusers import SD3Transformer2DModel

    cfg = dict(SD3Transformer2DModel.load_config(out / "transformer"))
    cfg.update(num_layers=layers, num_attention_heads=heads, attention_head_dim=head_dim,
               caption_projection_dim=heads * head_dim)
    return cfg


def make_large_pipeline(out: Path, *, layers: int, heads: int, head_dim: int, seed: int = 0,
                        dtype: torch.dtype = torch.float32) -> Path:
    """The tiny SD3 pipeline at ``out`` with its DiT replaced by a ``layers``-block, ``heads * head_dim``
    wide one (random weights from ``seed``, stored in ``dtype``); the text encoders and VAE stay tiny."""
    from diffusers import SD3Transformer2DModel

    from megaflow.models.tiny_pipeline import make_tiny_pipeline

    make_tiny_pipeline("sd3", out, seed=seed)
    cfg = _dit_config(out, layers=layers, heads=heads, head_dim=head_dim)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: no float32 copy of a large model first
    try:
        dit = SD3Transformer2DModel.from_config(cfg)
    finally:
        torch.set_default_dtype(default)
    dit.to(dtype)
    for module in dit.modules():  # buffers (the positional table) stay float32, as an engine holds them
        for name, buf in module.named_buffers(recurse=False):
            setattr(module, name, buf.float())
    dit.save_pretrained(out / "transformer")
    return out


def _count(cfg: dict) -> int:
    from diffusers import SD3Transformer2DModel

    with torch.device("meta"):
        return sum(p.numel() for p in SD3Transformer2DModel.from_config(cfg).parameters())


def shape_for_params(params: float, base: dict) -> dict:
    """SD3-like block shapes of about ``params`` parameters: head width 64, 12 heads (SD3's 768-wide blocks) below
    400M, else 24 (SD3-Medium's 1536); the number of blocks that comes nearest. ``base``: the tiny DiT's config."""
    heads = 12 if params < 4e8 else 24
    one, two = (_count({**base, "num_layers": n, "num_attention_heads": heads, "attention_head_dim": 64,
                        "caption_projection_dim": heads * 64}) for n in (1, 2))
    layers = max(1, round((params - (2 * one - two)) / (two - one)))
    return {"layers": layers, "heads": heads, "head_dim": 64}


def _source_state(pipeline_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """The DiT's tensors (engine names, shapes, dtypes) with new random values."""
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed)
    state = {}
    for f in sorted((pipeline_dir / "transformer").glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            state[name] = torch.randn(t.shape, generator=gen).to(t.dtype)
    return state


def _rates(nbytes: int, seconds: dict[str, float]) -> dict[str, float]:
    return {k: _sig(nbytes / s / 1e9) if s > 0 else None for k, s in seconds.items()}


def _sig(x: float) -> float:
    """``x`` to 4 significant digits."""
    return float(f"{x:.4g}")


def _bench_model(pipeline_dir: Path, *, engines: int, repeats: int, warmup: int, bucket_mb: float,
                 seed: int, checksum: str, precision: str) -> dict:
    from megaflow.bridge.buckets import StagingSlots
    from megaflow.bridge.shared_memory import SharedMemoryBridge
    from megaflow.rollout.sglang import SGLangEngine, SGLangEngineConfig, weights_checksum

    source = Source(_source_state(pipeline_dir, seed), json.loads((pipeline_dir / "transformer" / "config.json")
                                                                   .read_text()))
    bucket_bytes = int(bucket_mb * 2**20)
    slots = StagingSlots()  # one set of shared-memory slots for the phases and both bridges (one model's bytes)
    phases = trainer_phases(source, bucket_bytes=bucket_bytes, checksum=checksum, slots=slots)
    started = [SGLangEngine(SGLangEngineConfig(model_path=str(pipeline_dir), engine_id=f"sync-{i}",
                                               checksum=checksum, precision=precision,
                                               server_kwargs={"sleep_on_idle": True})) for i in range(engines)]
    out: dict = {"params": sum(t.numel() for t in source.engine_state.values()), "bytes": source.nbytes,
                 "num_tensors": len(source.engine_state), "engines": engines}
    try:
        bridges = {key: SharedMemoryBridge(started, bucket_bytes=bucket_bytes, verify=key == "verify",
                                           checksum=checksum, staging=slots) for key in ("no_verify", "verify")}
        reports = {key: [] for key in bridges}
        for _ in range(warmup):
            for bridge in bridges.values():
                bridge.push(source.stream())
        timed = time_rounds({**phases, **{key: (lambda k=key: reports[k].append(
            bridges[k].push(source.stream()))) for key in bridges}}, repeats,
            pids=[pid for e in started for pid in e.health().worker_pids])
        pushes, fastest, cpu = timed["median"], timed["fastest"], timed["cpu"]
        assert all(r.verified for r in reports["verify"]) and not any(r.verified for r in reports["no_verify"])
        out["num_buckets"] = reports["verify"][-1].num_buckets
        copy_s = pushes["copy"]
        out["copy_s"] = _sig(copy_s)
        out["sync_s"] = {key: _sig(pushes[key]) for key in bridges}
        out["ratio_vs_copy"] = {key: _sig(pushes[key] / copy_s) for key in bridges}
        out["ratio_fastest_vs_copy"] = {key: _sig(fastest[key] / fastest["copy"]) for key in bridges}
        out["cpu_ratio_vs_copy"] = {key: _sig(cpu[key] / cpu["copy"]) for key in bridges}
        out["phase_cpu_s"] = {k: _sig(v) for k, v in phase_seconds(cpu).items()}
        out["per_engine_s"] = {key: _sig(pushes[key] / engines) for key in bridges}
        out["phase_s"] = {k: _sig(v) for k, v in phase_seconds(pushes).items()}
        out["phase_gb_per_s"] = _rates(source.nbytes, out["phase_s"])
        expected = weights_checksum(source.engine_state.items())
        out["bit_exact"] = all(e.checksum() == expected for e in started)
    finally:
        for e in started:
            e.shutdown()
    return out


def bench_sync(*, layers: int = 6, heads: int = 12, head_dim: int = 64, params: float | None = None, engines: int = 1,
               repeats: int = 5, warmup: int = 1, bucket_mb: float = 64.0, seed: int = 0, tiny: bool = True,
               checksum: str = "xxh3", precision: str = "fp32") -> dict:
    """Sync seconds (verify off / on), their ratio to a plain copy and each phase's bytes/s, for the large DiT
    (``params``: its shape from ``shape_for_params``) and (``tiny``) the tiny one; see the module's design notes."""
    if layers < 1 or heads < 1 or head_dim < 1 or engines < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"need layers, heads, head_dim, engines, repeats >= 1 and warmup >= 0, got "
                         f"{layers}, {heads}, {head_dim}, {engines}, {repeats}, {warmup}")
    if params is not None and not 1e5 <= params <= 2e10:
        raise ValueError(f"--params must be between 1e5 and 2e10, got {params:g}")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(precision)
    if dtype is None:
        raise ValueError(f"precision must be fp32 or bf16, got {precision!r}")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="megaflow-bench-sync-") as tmp:
        from megaflow.models.tiny_pipeline import make_tiny_pipeline

        small = make_tiny_pipeline("sd3", Path(tmp) / "tiny-sd3", seed=seed)
        if params is not None:
            shape = shape_for_params(params, _dit_config(small, layers=1, heads=heads, head_dim=head_dim))
            layers, heads, head_dim = shape["layers"], shape["heads"], shape["head_dim"]
        result: dict = {"config": {"layers": layers, "heads": heads, "head_dim": head_dim, "params": params,
                                   "precision": precision, "engines": engines, "repeats": repeats, "warmup": warmup,
                                   "bucket_mb": bucket_mb, "seed": seed, "checksum": checksum,
                                   "cpu_count": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                                   "load_before": [round(x, 2) for x in os.getloadavg()]}}
        large = make_large_pipeline(Path(tmp) / "large-sd3", layers=layers, heads=heads, head_dim=head_dim,
                                    seed=seed, dtype=dtype)
        kwargs = dict(engines=engines, repeats=repeats, warmup=warmup, bucket_mb=bucket_mb, seed=seed + 1,
                      checksum=checksum)
        result["large"] = _bench_model(large, precision=precision, **kwargs)
        if tiny:
            result["tiny"] = _bench_model(small, precision="fp32", **kwargs)
    result["config"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
    return result
