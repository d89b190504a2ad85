"""The mirror check's two halves (``scripts/gpu_mirror_check.sh``): sample a rollout from the tiny SD3 engine in
whatever environment runs this, and compare two such samples.

Invariant: both sample the SAME pipeline with the same requests, so any difference comes from the environment.
Design notes: docs/design/testing.md.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import sys
import time
from pathlib import Path

TOLERANCE = 1e-5
"""Largest relative max difference of log-probs, latents, velocities that passes (docs/design/testing.md)."""
PROVES = ("sglang 0.5.23 (slimmed, without its dependencies), megatron-core, diffusers and megaflow from the GPU "
          "wheelhouse import and run the tiny SD3 engine on the GPU image's stack (torch 2.11.0, triton 3.6.0, "
          "transformers 5.17.0) with nothing but the image's packages beneath them, no shim or environment variable "
          "needed; its rollout equals the full venv's (torch 2.14.1, transformers 5.19.0) within the tolerance; on "
          "CPU the sgl_kernel stand-in refuses to import, as the real CUDA package does, so no kernel of it is used. "
          "Not proved here: anything CUDA (the engine checks of scripts/gpu_check.sh).")
"""What a passing record shows (kept in the record)."""
VERSIONED = ("python", "torch", "triton", "transformers", "diffusers", "sglang", "megatron-core", "numpy",
             "huggingface_hub", "tokenizers", "safetensors")


def versions() -> dict:
    """Versions of the packages the result depends on (None: not installed)."""
    out = {"python": sys.version.split()[0]}
    for name in VERSIONED[1:]:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def requests(steps: int):
    """The rollout both environments sample: two prompts, five seeds, SDE steps with log-probs and velocities."""
    from megaflow.rollout.types import RolloutRequest

    return [RolloutRequest(prompt="a red cat", num_outputs=3, seed=5, num_steps=steps, request_id="g0",
                           return_model_outputs=True),
            RolloutRequest(prompt="a blue dog", num_outputs=2, seeds=[40, 7], num_steps=steps, request_id="g1",
                           return_model_outputs=True)]


def sample(pipeline_dir: str, out: str, steps: int = 4) -> dict:
    """Start the engine on ``pipeline_dir`` (fp32, 1 thread), sample ``requests(steps)``; save the tensors and the
    versions to ``out`` (torch.save); the summary record."""
    import torch

    import megaflow  # noqa: F401  (import guards before sglang)
    import megaflow.rollout.sglang as sglang_engine

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    engine = sglang_engine.SGLangEngine(sglang_engine.SGLangEngineConfig(model_path=pipeline_dir, num_threads=1))
    try:
        start_s = time.perf_counter() - t0
        trajs = engine.generate(requests(steps))
    finally:
        engine.shutdown()
    data = {"log_probs": torch.stack([t.log_probs for t in trajs]),
            "latents": torch.stack([t.latents for t in trajs]),
            "model_outputs": torch.stack([t.model_outputs for t in trajs]),
            "images": torch.stack([t.image for t in trajs]),
            "seeds": [t.seed for t in trajs], "versions": versions(),
            "sgl_kernel": _standin_report(), "start_s": start_s, "seconds": time.perf_counter() - t0}
    torch.save(data, out)
    return {k: v for k, v in data.items() if not hasattr(v, "shape")}


def _standin_report() -> dict:
    """Which ``sgl_kernel`` this environment has, and what the stand-in's log (``SGL_KERNEL_STANDIN_LOG``) holds:
    the processes that imported it, refused to (no CUDA), and the names they looked up in it."""
    import importlib.util

    spec = importlib.util.find_spec("sgl_kernel")
    origin = Path(spec.origin) if spec is not None and spec.origin else None
    log = os.environ.get("SGL_KERNEL_STANDIN_LOG")
    rows = [ln.split() for ln in Path(log).read_text().splitlines()] if log and Path(log).is_file() else []
    return {"installed": spec is not None,
            "standin": bool(origin and origin.is_file() and "STANDIN = True" in origin.read_text(errors="replace")),
            "imported_by_pids": sorted({r[0] for r in rows if r[1:2] == ["import"]}),
            "refused_in_pids": sorted({r[0] for r in rows if r[1:2] == ["refused"]}),
            "names_looked_up": sorted({r[2] for r in rows if r[1:2] == ["lookup"]})}


def compare_tensors(ref: dict, got: dict, tol: float = TOLERANCE) -> dict:
    """Per tensor of ``ref`` / ``got`` (dicts of torch tensors): max |got - ref|, that relative to max |ref|,
    whether bit-identical; ``ok`` when every relative error is <= ``tol`` and the seeds match."""
    out, ok = {}, ref.get("seeds") == got.get("seeds")
    for name in ("log_probs", "latents", "model_outputs", "images"):
        a, b = ref[name].double(), got[name].double()
        if a.shape != b.shape:
            out[name] = {"ok": False, "error": f"shape {tuple(b.shape)} vs {tuple(a.shape)}"}
            ok = False
            continue
        err = float((b - a).abs().max())
        rel = err / max(float(a.abs().max()), 1e-30)
        out[name] = {"max_abs": err, "rel": rel, "ref_max_abs": float(a.abs().max()), "identical": err == 0.0,
                     "ok": rel <= tol}
        ok = ok and rel <= tol
    return {"ok": ok, "tol": tol, "seeds_match": ref.get("seeds") == got.get("seeds"), "tensors": out}


def wheelhouse_record(wheels: str | None, install_log: str | None) -> dict:
    """What the mirror had on top of the image: the wheelhouse's files and bytes, and gpu_check.sh's install line."""
    out: dict = {}
    if wheels and Path(wheels).is_dir():
        from megaflow.testing.gpu.wheelhouse import tree_bytes

        files = {p.name: p.stat().st_size for p in sorted(Path(wheels).glob("*.whl"))}
        out.update(wheel_bytes=files, wheelhouse_total_bytes=sum(files.values()))
        if (Path(wheels).parent / ".git").exists():  # gpu_wheels/ of a checkout: what a GPU call carries in all
            out["carried_with_tree_bytes"] = sum(files.values()) + tree_bytes(Path(wheels).parent)
    if install_log and Path(install_log).is_file():
        line = next((ln for ln in Path(install_log).read_text().splitlines() if ln.startswith("install:")), "")
        out["installed"] = line.removeprefix("install:").split(" (from ")[0].split()  # no machine paths
    return out


def compare(reference: str, mirror: str, tol: float = TOLERANCE, wheels: str | None = None,
            install_log: str | None = None) -> dict:
    """The mirror check's record: ``mirror``'s rollout against ``reference``'s (files of ``sample``)."""
    import torch

    ref, got = torch.load(reference, weights_only=False), torch.load(mirror, weights_only=False)
    res = compare_tensors(ref, got, tol)
    kernel = got["sgl_kernel"]
    untouched = not kernel["names_looked_up"] and not kernel["imported_by_pids"]  # on CPU: refused, never used
    lp, nan = res["tensors"]["log_probs"], float("nan")
    return {"check": "cpu_mirror", "status": "pass" if res["ok"] and untouched else "fail", "proves": PROVES, **res,
            "reference_versions": ref["versions"], "mirror_versions": got["versions"],
            "mirror_sgl_kernel": kernel, "standin_never_reached": untouched,
            "log_probs_shape": list(ref["log_probs"].shape), **wheelhouse_record(wheels, install_log),
            "headline": f"log-probs max |diff| {lp.get('max_abs', nan):.3g} (rel {lp.get('rel', nan):.3g}, "
                        f"tol {tol:g}); stand-in reached: {not untouched}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megaflow.testing.gpu.mirror", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("sample", "compare"))
    ap.add_argument("a", help="sample: the pipeline directory; compare: the reference's file")
    ap.add_argument("b", help="sample: where the tensors go; compare: the mirror's file")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tol", type=float, default=TOLERANCE)
    ap.add_argument("--result", help="compare: write the record here (JSON) too")
    ap.add_argument("--wheels", help="compare: the wheelhouse the mirror installed from (recorded)")
    ap.add_argument("--install-log", help="compare: gpu_check.sh's install.log of the mirror (recorded)")
    args = ap.parse_args(argv)
    rec = sample(args.a, args.b, args.steps) if args.what == "sample" else \
        compare(args.a, args.b, args.tol, args.wheels, args.install_log)
    line = json.dumps(rec, default=str)
    print(line, flush=True)
    if args.what == "compare" and args.result:
        Path(args.result).write_text(json.dumps(rec, indent=1, default=str) + "\n")
    return 0 if rec.get("status", "pass") == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
