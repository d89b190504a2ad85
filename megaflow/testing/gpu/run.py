"""The GPU check driver: an environment record, then every check of ``CHECKS`` in its own process and timeout
within one budget; JSON lines to ``<out>/gpu_check.jsonl``, logs and a summary table.

A check with unmet needs is skipped; one that raises or times out (process group killed) reports ``fail``; the
driver always goes on. Design notes: docs/design/testing.md.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megaflow.testing.gpu.common import Skip, error_line, error_summary, probe_import

PROBED = ("megatron.core", "diffusers", "transformer_engine", "sglang")
ENGINE_NEEDS = ("cuda", "sglang", "megatron.core", "diffusers")


@dataclass(frozen=True)
class Check:
    target: str            # "module:function" returning the record's fields (status, metrics)
    timeout_s: int
    needs: tuple[str, ...]  # "cuda" and/or modules of PROBED that must import


CHECKS = {
    "nccl": Check("megaflow.testing.gpu.comm:nccl", 90, ("cuda",)),
    "cuda_ipc": Check("megaflow.testing.gpu.comm:cuda_ipc", 90, ("cuda",)),
    "parity_local": Check("megaflow.testing.gpu.model:parity_local", 150, ("cuda", "megatron.core", "diffusers")),
    "step_sd35m_recompute_none": Check("megaflow.testing.gpu.model:step_recompute_none", 150,
                                       ("cuda", "megatron.core")),
    "step_sd35m_recompute_full": Check("megaflow.testing.gpu.model:step_recompute_full", 150,
                                       ("cuda", "megatron.core")),
    "step_flux_lora_r32": Check("megaflow.testing.gpu.model:step_flux_lora", 180, ("cuda", "megatron.core")),
    "step_qwen_image_8blocks": Check("megaflow.testing.gpu.model:step_qwen_image", 180, ("cuda", "megatron.core")),
    "offload": Check("megaflow.testing.gpu.offload:offload", 150, ("cuda", "megatron.core")),
    "pretrain_parity": Check("megaflow.testing.gpu.pretrain:pretrain_parity", 240,
                             ("cuda", "megatron.core", "diffusers")),
    "parity_te": Check("megaflow.testing.gpu.model:parity_te", 120,
                       ("cuda", "megatron.core", "diffusers", "transformer_engine")),
    "engine_sd3": Check("megaflow.testing.gpu.engine:engine_sd3", 150, ENGINE_NEEDS),
    "engine_sync": Check("megaflow.testing.gpu.engine:engine_sync", 90, ENGINE_NEEDS),
    "engine_release": Check("megaflow.testing.gpu.engine:engine_release", 90, ENGINE_NEEDS),
    "engine_flux": Check("megaflow.testing.gpu.engine:engine_flux", 90, ENGINE_NEEDS),
    "sd35m_rollout": Check("megaflow.testing.gpu.sd35m:sd35m_rollout", 180, ENGINE_NEEDS),
    "sd35m_train_step": Check("megaflow.testing.gpu.sd35m:sd35m_train_step", 120, ("cuda", "megatron.core")),
    "sd35m_loop_nft": Check("megaflow.testing.gpu.sd35m:sd35m_loop_nft", 180, ENGINE_NEEDS),
    "sd35m_loop_flowgrpo": Check("megaflow.testing.gpu.sd35m:sd35m_loop_flowgrpo", 200, ENGINE_NEEDS),
}
GROUPS = {"trainer": [n for n in CHECKS if not n.startswith(("engine_", "sd35m_"))],
          "engine": ["engine_sd3", "sd35m_rollout", "sd35m_loop_nft", "sd35m_train_step", "engine_sync",
                     "engine_release", "engine_flux", "sd35m_loop_flowgrpo"]}
"""``--only`` names a check or one of these groups; checks run in the order named. engine: the SGLang engine checks
and the SD3.5-M table, most wanted first (the prepared run of a GPU lease: ``GPU_CHECK_ONLY=engine bash
scripts/gpu_check.sh``, ~8 min; what the budget leaves out skips)."""
VERSIONS = ("torch", "triton", "transformers", "diffusers", "megatron-core", "sglang", "numpy", "huggingface-hub",
            "pydantic", "tokenizers", "safetensors")


def environment() -> dict:
    """Python, torch, CUDA, the device and which of ``PROBED`` import (really imported with a CUDA device; only
    looked up without one, where the checks skip anyway and the imports would cost a minute of CPU)."""
    rec: dict = {"check": "env", "status": "info", "python": sys.version.split()[0]}
    try:
        import torch
    except BaseException as e:  # noqa: BLE001
        return {**rec, "torch": None, "cuda_available": False, "error": error_line(e),
                "imports": {m: probe_import(m, really=False) for m in PROBED}}
    cuda = torch.cuda.is_available()
    rec.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=cuda,
               device_count=torch.cuda.device_count() if cuda else 0)
    if cuda:
        p = torch.cuda.get_device_properties(0)
        rec.update(device=p.name, memory_gib=round(p.total_memory / 2**30, 2), capability=f"{p.major}.{p.minor}",
                   gpu_uuid=str(p.uuid), nccl=".".join(map(str, torch.cuda.nccl.version())))
    really = cuda or os.environ.get("GPU_CHECK_IMPORTS") == "1"
    rec["imports"] = {m: probe_import(m, really=really) for m in PROBED}
    rec.update(installed_versions())
    return rec


def installed_versions() -> dict:
    """{"versions": the ``VERSIONS`` packages' (None: absent), "packages": every distribution as name==version}."""
    import importlib.metadata as md

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    dists = sorted({f"{d.metadata['Name']}=={d.version}" for d in md.distributions() if d.metadata["Name"]},
                   key=str.lower)
    return {"versions": {n: version(n) for n in VERSIONS}, "packages": dists}


def expand_only(names: list[str] | None) -> list[str] | None:
    """``--only``'s names with each group of ``GROUPS`` replaced by its checks (each check once, first mention
    first); an unknown name is an error."""
    if not names:
        return None
    out = []
    for n in names:
        if n not in CHECKS and n not in GROUPS:
            raise SystemExit(f"--only: unknown check or group {n!r} (groups: {', '.join(GROUPS)})")
        out.extend(c for c in GROUPS.get(n, [n]) if c not in out)
    return out


def run_in_process(name: str) -> dict:
    """Run check ``name`` here: its record, ``skipped`` on Skip, ``fail`` with the error's last line."""
    module, _, func = CHECKS[name].target.partition(":")
    t0 = time.perf_counter()
    try:
        fields = getattr(importlib.import_module(module), func)()
    except Skip as s:
        fields = {"status": "skipped", "reason": str(s)}
    except BaseException as e:  # noqa: BLE001 - reported, never raised
        import traceback

        traceback.print_exc()
        fields = {"status": "fail", "error": error_line(e)}
    return {"check": name, **fields, "seconds": round(time.perf_counter() - t0, 2)}


def unmet_need(check: Check, env: dict) -> str | None:
    """Why ``check`` cannot run in ``env`` (None: it can)."""
    for need in check.needs:
        if need == "cuda" and not env.get("cuda_available"):
            return "no CUDA device (torch.cuda.is_available() is False)" if env.get("torch") else \
                f"torch does not import: {env.get('error', '?')}"
        if need != "cuda" and not env.get("imports", {}).get(need, {}).get("ok"):
            return f"{need} does not import: {env['imports'].get(need, {}).get('error', 'not probed')}"
    return None


def spawn(args: list[str], timeout_s: float, log: Path) -> tuple[dict | None, str]:
    """Run ``python -m megaflow.testing.gpu <args> --result F`` in its own process group; (the record it wrote or
    None, why not). On timeout the group gets SIGTERM, then SIGKILL after 10 s."""
    result = log.with_suffix(".json")
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "megaflow.testing.gpu", *args, "--result", str(result)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return None, f"timed out after {timeout_s:.0f} s (killed)"
    if result.is_file():
        return json.loads(result.read_text()), ""
    tail = error_summary(log.read_bytes()[-20000:].decode(errors="replace"))
    return None, f"exit code {rc} without a result: {tail}"


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def summary(records: list[dict]) -> str:
    """A fixed-width table: check, status, seconds, and the reason / error / headline numbers."""
    rows = [f"{'check':<28} {'status':<8} {'seconds':>8}  detail"]
    for r in records:
        if r["check"] == "env":
            continue
        detail = r.get("reason") or r.get("error") or r.get("headline", "")
        rows.append(f"{r['check']:<28} {r['status']:<8} {r.get('seconds', 0):>8.1f}  {detail}")
    return "\n".join(rows)


def run_all(out: Path, budget_s: float, only: list[str] | None) -> list[dict]:
    """The environment record, then each check (``only``: these, in that order), within ``budget_s`` seconds
    overall."""
    deadline = time.monotonic() + budget_s
    (out / "logs").mkdir(parents=True, exist_ok=True)
    jsonl = out / "gpu_check.jsonl"
    jsonl.write_text("")

    def emit(rec: dict) -> None:
        line = json.dumps(rec, default=str)
        print(line, flush=True)
        with jsonl.open("a") as f:
            f.write(line + "\n")

    env, why = spawn(["env"], min(180.0, budget_s), out / "logs" / "env.log")
    env = env or {"check": "env", "status": "fail", "error": why, "cuda_available": False, "torch": None}
    records = [env]
    emit(env)
    for name in only or CHECKS:
        check = CHECKS[name]
        left = deadline - time.monotonic()
        reason = unmet_need(check, env) or (None if left > 20 else f"overall budget of {budget_s:.0f} s spent")
        if reason:
            rec = {"check": name, "status": "skipped", "reason": reason}
        else:
            t0 = time.monotonic()
            rec, why = spawn(["check", name], min(check.timeout_s, left), out / "logs" / f"{name}.log")
            rec = rec or {"check": name, "status": "fail", "error": why, "seconds": round(time.monotonic() - t0, 2)}
        records.append(rec)
        emit(rec)
    table = summary(records)
    (out / "gpu_check_summary.txt").write_text(table + "\n")
    print(table, flush=True)
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megaflow.testing.gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", help="all | env | check")
    ap.add_argument("name", nargs="?", help="with check: one of " + ", ".join(CHECKS))
    ap.add_argument("--out", default="gpu_check_out", help="with all: where the records go")
    ap.add_argument("--budget", type=float, default=420.0, help="with all: seconds for every check together")
    ap.add_argument("--only", default="", help="with all: comma-separated check or group names (" +
                    ", ".join(GROUPS) + ")")
    ap.add_argument("--result", help="with env / check: write the record here (JSON) too")
    args = ap.parse_args(argv)
    if args.what == "all":
        run_all(Path(args.out), args.budget, expand_only([n for n in args.only.split(",") if n]))
        return 0
    if args.what == "env":
        rec = environment()
    elif args.what == "check" and args.name in CHECKS:
        rec = run_in_process(args.name)
    else:
        ap.error(f"expected 'all', 'env' or 'check NAME' (NAME one of {', '.join(CHECKS)})")
    line = json.dumps(rec, default=str)
    print(line, flush=True)
    if args.result:
        Path(args.result).write_text(line)
    return 0
