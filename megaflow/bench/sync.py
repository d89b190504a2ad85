"""``megaflow bench sync``: weight-sync seconds into SGLang engines vs a plain copy of the same bytes, on a
scaled-up (``large``, ~110M params by default) and the ``tiny`` SD3 pipeline. Design notes: docs/design/bench.md.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

__all__ = ["bench_sync", "make_large_pipeline"]


def make_large_pipeline(out: Path, *, layers: int, heads: int, head_dim: int, seed: int = 0) -> Path:
    """The tiny SD3 pipeline at ``out`` with its DiT replaced by a ``layers``-block, ``heads * head_dim``
    wide one (random weights from ``seed``); the text encoders and VAE stay tiny."""
    from diffusers import SD3Transformer2DModel

    from megaflow.models.tiny_pipeline import make_tiny_pipeline

    make_tiny_pipeline("sd3", out, seed=seed)
    cfg = SD3Transformer2DModel.load_config(out / "transformer")
    cfg.update(num_layers=layers, num_attention_heads=heads, attention_head_dim=head_dim,
               caption_projection_dim=heads * head_dim)
    torch.manual_seed(seed)
    SD3Transformer2DModel.from_config(cfg).save_pretrained(out / "transformer")
    return out


def _sig(x: float) -> float:
    """``x`` to 4 significant digits (seconds span 1e-5 .. 10 here)."""
    return float(f"{x:.4g}")


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _source_state(pipeline_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """The DiT's tensors (engine names, shapes, dtypes) with new random values."""
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(seed)
    state = {}
    for f in sorted((pipeline_dir / "transformer").glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            state[name] = torch.randn(t.shape, generator=gen).to(t.dtype)
    return state


def _bench_model(pipeline_dir: Path, *, engines: int, repeats: int, warmup: int, bucket_mb: float,
                 seed: int, checksum: str) -> dict:
    from megaflow.bridge.shared_memory import SharedMemoryBridge
    from megaflow.rollout.sglang import SGLangEngine, SGLangEngineConfig, weights_checksum

    state = _source_state(pipeline_dir, seed)
    dst = {n: torch.empty_like(t) for n, t in state.items()}

    def copy():
        for n, t in state.items():
            dst[n].copy_(t)
    copy()  # touch dst
    copies: list[float] = []
    t0 = time.perf_counter()
    started = [SGLangEngine(SGLangEngineConfig(model_path=str(pipeline_dir), engine_id=f"sync-{i}",
                                               checksum=checksum, server_kwargs={"sleep_on_idle": True})) for i in range(engines)]
    start_s = time.perf_counter() - t0
    out: dict = {"params": sum(t.numel() for t in state.values()),
                 "bytes": sum(t.numel() * t.element_size() for t in state.values()), "num_tensors": len(state),
                 "engines": engines, "engine_start_s": round(start_s, 2),
                 "sync_s": {}, "ratio_vs_copy": {}, "per_engine_s": {}}
    try:
        for verify in (False, True):
            key = "verify" if verify else "no_verify"
            bridge = SharedMemoryBridge(started, bucket_bytes=int(bucket_mb * 2**20), verify=verify,
                                     checksum=checksum)
            reports = []
            for _ in range(warmup):
                bridge.push(state.items())
            pairs = [(_seconds(copy), _seconds(lambda: reports.append(bridge.push(state.items()))))
                     for _ in range(repeats)]
            assert all(r.verified == verify for r in reports), reports
            copies += [c for c, _ in pairs]
            seconds = statistics.median(s for _, s in pairs)
            out["sync_s"][key] = _sig(seconds)
            out["per_engine_s"][key] = _sig(seconds / engines)
            out["num_buckets"] = reports[-1].num_buckets
        copy_s = out["copy_s"] = _sig(statistics.median(copies))
        out["ratio_vs_copy"] = {key: _sig(seconds / copy_s) for key, seconds in out["sync_s"].items()}
        expected = weights_checksum(state.items())
        out["bit_exact"] = all(e.checksum() == expected for e in started)
    finally:
        for e in started:
            e.shutdown()
    return out


def bench_sync(*, layers: int = 6, heads: int = 12, head_dim: int = 64, engines: int = 1, repeats: int = 5,
               warmup: int = 1, bucket_mb: float = 64.0, seed: int = 0, tiny: bool = True,
               checksum: str = "xxh3") -> dict:
    """Sync seconds (verify off / on) and their ratio to a plain copy, for the large DiT and (``tiny``) the
    tiny one; see the module's design notes."""
    if layers < 1 or heads < 1 or head_dim < 1 or engines < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"need layers, heads, head_dim, engines, repeats >= 1 and warmup >= 0, got "
                         f"{layers}, {heads}, {head_dim}, {engines}, {repeats}, {warmup}")
    torch.set_num_threads(1)
    result: dict = {"config": {"layers": layers, "heads": heads, "head_dim": head_dim, "engines": engines,
                               "repeats": repeats, "warmup": warmup, "bucket_mb": bucket_mb, "seed": seed,
                               "checksum": checksum,
                               "cpu_count": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                               "load_before": [round(x, 2) for x in os.getloadavg()]}}
    with tempfile.TemporaryDirectory(prefix="megaflow-bench-sync-") as tmp:
        large = make_large_pipeline(Path(tmp) / "large-sd3", layers=layers, heads=heads, head_dim=head_dim,
                                    seed=seed)
        result["large"] = _bench_model(large, engines=engines, repeats=repeats, warmup=warmup,
                                       bucket_mb=bucket_mb, seed=seed + 1, checksum=checksum)
        if tiny:
            from megaflow.models.tiny_pipeline import make_tiny_pipeline

            small = make_tiny_pipeline("sd3", Path(tmp) / "tiny-sd3", seed=seed)
            result["tiny"] = _bench_model(small, engines=engines, repeats=repeats, warmup=warmup,
                                          bucket_mb=bucket_mb, seed=seed + 1, checksum=checksum)
    result["config"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
    return result
