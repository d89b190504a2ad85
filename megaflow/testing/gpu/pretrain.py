"""GPU check of ``megaflow pretrain`` on CUDA: the same short continued pretraining on CPU and CUDA must give the
same DiT update within ``TOLERANCE`` (relative norm). Details: docs/design/testing.md.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megaflow.testing.gpu.common import Skip, error_summary, require_cuda, require_module

TOLERANCE = 0.1
"""Largest relative difference of the two devices' DiT updates."""
START = Path("assets/shapeeval-sd3")
"""The pipeline both runs continue from, relative to the repository root (the check's working directory)."""
SETTINGS = ("pretrain.num_images=256", "pretrain.batch_size=32", "pretrain.max_steps=12", "pretrain.warmup_steps=4",
            "pretrain.lr=5e-4", "pretrain.eval_every=12", "pretrain.eval_prompts=8", "pretrain.minutes=10",
            "run.seed=3", "run.num_threads=4", 'model.spec="local"')


def pretrain_parity() -> dict:
    require_cuda()
    require_module("megatron.core")
    require_module("diffusers")
    return compare_devices(("cpu", "cuda"), Path.cwd())


def _run(device: str, repo: Path, out: Path, timeout_s: float, settings: tuple[str, ...] = SETTINGS) -> float:
    """One ``megaflow pretrain`` process on ``device`` into ``out`` with ``settings``; its seconds. RuntimeError with
    its last line."""
    sets = [*settings, f'run.device="{device}"', f'run.output_dir="{out}"', 'run.name="parity"',
            f'pretrain.init_from="{repo / START}"']
    cmd = [sys.executable, "-m", "megaflow.cli", "pretrain", "-c", str(repo / "configs" / "shapes_pretrain.toml")]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode:
        raise RuntimeError(f"pretrain on {device} exited {proc.returncode}: {error_summary(proc.stderr or proc.stdout)}")
    return time.perf_counter() - t0


def compare_devices(devices: tuple[str, str], repo: Path, timeout_s: float = 240.0,
                    settings: tuple[str, ...] = SETTINGS) -> dict:
    """The check's body: the two runs' DiT updates and their relative difference (the CPU test runs it with
    ("cpu", "cpu"), where the runs are bit-identical, and smaller ``settings``)."""
    from safetensors.torch import load_file

    if not (repo / START / "model_index.json").is_file():
        raise Skip(f"{START} is not here (run the check from the repository root)")
    weights = "transformer/diffusion_pytorch_model.safetensors"
    start = load_file(str(repo / START / weights))
    updates, seconds, rows = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for k, device in enumerate(devices):
            out = Path(tmp) / f"run{k}"
            seconds[f"{device}_{k}"] = round(_run(device, repo, out, timeout_s, settings), 1)
            saved = load_file(str(out / "parity" / "pipeline" / weights))
            updates.append({n: saved[n].double() - start[n].double() for n in start})
            rows[f"{device}_{k}"] = json.loads((out / "parity" / "pretrain.jsonl").read_text().splitlines()[-1])
    diff = sum(float((updates[1][n] - updates[0][n]).pow(2).sum()) for n in start) ** 0.5
    size = sum(float(updates[0][n].pow(2).sum()) for n in start) ** 0.5
    rel = diff / size if size else float("inf")
    return {"status": "pass" if rel <= TOLERANCE else "fail", "update_rel_diff": rel, "tolerance": TOLERANCE,
            "update_norm": size, "run_seconds": seconds,
            "loss": {k: r["loss"] for k, r in rows.items()}, "accuracy": {k: r["accuracy"] for k, r in rows.items()},
            "headline": f"{devices[1]} vs {devices[0]}: DiT update rel diff {rel:.2e} (tol {TOLERANCE}) after "
                        f"{rows[f'{devices[0]}_0']['step']} steps; losses "
                        + ", ".join(f"{k} {r['loss']:.5f}" for k, r in rows.items())}
