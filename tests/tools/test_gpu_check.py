"""scripts/gpu_check.sh and megaflow.testing.gpu on a machine without CUDA.

Needs: CPU; subprocesses (the script: ~10 s, mostly importing torch; the wheelhouse install: ~10 s, only where
scripts/gpu_wheels.sh has built gpu_wheels/; slow: the model check bodies in one interpreter, ~1 min, and the
pretrain parity's two small pretraining runs). Checks:
- the script exits 0 and writes an env record plus one record per check, every check ``skipped`` with a reason
  (CUDA hidden), and a summary table;
- the driver's failure, skip and need logic in-process;
- the SD3.5-M memory prediction of the step check equals ``megaflow plan``'s trainer items for that setting;
- (slow) the bodies of the NCCL and CUDA IPC checks on CPU (gloo; shared memory to a spawned child), of the
  parity check (megatron local spec vs diffusers), of the step and offload checks (a tiny model of the same input
  shapes) and of the pretrain parity check (two seeded, small CPU runs of ``megaflow pretrain``: bit-identical
  updates).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megaflow.testing.gpu import run
from megaflow.testing.gpu.common import Skip, error_summary

REPO = Path(__file__).resolve().parents[2]


def _script(tmp_path: Path, **env) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp_path / "out"
    full = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "CUDA_VISIBLE_DEVICES": "",
            "TMPDIR": str(tmp_path), **env}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, env=full, capture_output=True, text=True,
                          timeout=300)
    lines = (out / "gpu_check.jsonl").read_text().splitlines() if (out / "gpu_check.jsonl").is_file() else []
    return proc, [json.loads(line) for line in lines]


def test_script_skips_every_check_without_cuda(tmp_path):
    proc, records = _script(tmp_path, GPU_WHEELS=str(tmp_path / "no-wheels"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env, checks = records[0], records[1:]
    assert env["check"] == "env" and env["cuda_available"] is False and env["torch"], env
    assert set(env["imports"]) == set(run.PROBED)
    assert [r["check"] for r in checks] == list(run.CHECKS)
    for r in checks:
        assert r["status"] == "skipped" and r["reason"], r
    summary = (tmp_path / "out" / "gpu_check_summary.txt").read_text()
    assert all(name in summary for name in run.CHECKS)
    assert "no wheelhouse" in (tmp_path / "out" / "install.log").read_text()


@pytest.mark.skipif(not (REPO / "gpu_wheels").is_dir(), reason="no gpu_wheels/ (run scripts/gpu_wheels.sh)")
def test_script_installs_the_wheelhouse(tmp_path):
    proc, records = _script(tmp_path, GPU_CHECK_ONLY="nccl")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    site = tmp_path / "megaflow-gpu-site"
    assert (site / "megatron" / "core").is_dir() and (site / "diffusers").is_dir() and (site / "megaflow").is_dir()
    assert [r["check"] for r in records] == ["env", "nccl"] and records[1]["status"] == "skipped"


def test_driver_reports_failures_and_skips(monkeypatch):
    def boom():
        raise RuntimeError("first line\nthe last line")

    def skip():
        raise Skip("nothing to do here")

    monkeypatch.setitem(sys.modules, "fake_checks", type(sys)("fake_checks"))
    sys.modules["fake_checks"].boom, sys.modules["fake_checks"].skip = boom, skip
    monkeypatch.setitem(run.CHECKS, "boom", run.Check("fake_checks:boom", 5, ()))
    monkeypatch.setitem(run.CHECKS, "skip", run.Check("fake_checks:skip", 5, ()))
    failed = run.run_in_process("boom")
    assert failed["status"] == "fail" and failed["error"] == "the last line", failed
    exit_warning = "RuntimeError: the cause\n[rank0]:[W1128 14:42:27] Warning: destroy_process_group() was not called"
    assert error_summary(exit_warning) == "RuntimeError: the cause"  # a warning at exit does not hide the error
    assert error_summary("megaflow: config error: bad\nbye") == "megaflow: config error: bad"
    assert error_summary("no error named\nlast") == "last"
    assert run.run_in_process("skip") == {"check": "skip", "status": "skipped", "reason": "nothing to do here",
                                          "seconds": pytest.approx(0, abs=1)}
    env = {"torch": "2", "cuda_available": True, "imports": {"diffusers": {"ok": False, "error": "not installed"}}}
    assert run.unmet_need(run.Check("x:y", 1, ("cuda", "diffusers")), env) == "diffusers does not import: not installed"
    assert run.unmet_need(run.Check("x:y", 1, ("cuda",)), env) is None
    assert "no CUDA" in run.unmet_need(run.Check("x:y", 1, ("cuda",)), {**env, "cuda_available": False})


def test_step_prediction_is_megaflow_plans():
    from megaflow.config import load_config
    from megaflow.plan.memory import plan
    from megaflow.testing.gpu import model

    for recompute in ("none", "full"):
        ours = model.predicted(recompute)
        cfg = load_config(None, [*model.SETTINGS["sd3"], f"train.recompute={recompute}", "model.pretrained=no-such-dir"])
        result = plan(cfg, gpus=1, gpu_mem_gib=80)
        (group,) = result["groups"]
        assert (ours["image_tokens"], ours["text_tokens"]) == (result["image_tokens"], result["text_tokens"]) == (1024, 333)
        assert {k: group.items[k] for k in ours["items"]} == ours["items"]
        assert ours["info"] == group.info
    assert model.predicted("full")["items"]["activations"] < model.predicted("none")["items"]["activations"]


def _body(code: str, timeout: int = 240) -> dict:
    """Run ``code`` (which prints one JSON record last) in a fresh interpreter; the record."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# The check bodies the slow tests below run on CPU (``tiny_sd3``: a 2-block, hidden-16 DiT of SD3.5-M's input
# widths), one after another in one interpreter: they share its imports (torch, megatron, diffusers; ~10 s a
# process), and each sets up and tears down its own world.
BODIES = """import json, traceback, torch, megaflow
from megaflow.models.flux.tiny import tiny_config
from megaflow.models.qwen_image.tiny import tiny_config as qwen_tiny
from megaflow.plan.dit import BUILTIN
from megaflow.testing.gpu import comm, model, offload
cpu = torch.device('cpu')
tiny_sd3 = dict(BUILTIN['sd3'][1], num_layers=2, attention_head_dim=8, num_attention_heads=2,
                caption_projection_dim=16, dual_attention_layers=[0])
bodies = {
    'comm': lambda: {'a': comm.collectives_and_bridge(cpu, 'gloo'), 'b': comm.colocated_to_child(cpu)},
    'parity': lambda: model.velocity_parity('local', cpu),
    'step': lambda: {r: model.measure_step(r, cpu, tiny_sd3, steps=1) for r in ('none', 'full')},
    'flux_lora': lambda: model.measure_step('none', cpu, tiny_config(), steps=2, family='flux'),
    'qwen_image': lambda: model.measure_step('full', cpu, qwen_tiny(joint_attention_dim=32), steps=2,
                                             family='qwen_image'),
    'offload': lambda: offload.measure_offload(cpu, tiny_sd3),
}

def record(body):
    try:
        return body()
    except Exception:
        return {'error': traceback.format_exc()}

if __name__ == '__main__':
    print(json.dumps({name: record(body) for name, body in bodies.items()}, default=str))
"""


@pytest.fixture(scope="module")
def bodies() -> dict:
    """Each body's record by name (a body that raised: {"error": its traceback}); ~1 min."""
    return _body(BODIES, timeout=900)


def _record(bodies: dict, name: str) -> dict:
    rec = bodies[name]
    assert "error" not in rec, rec["error"]
    return rec


@pytest.mark.slow  # a spawned child imports torch and megaflow
def test_comm_bodies_on_cpu(bodies):
    rec = _record(bodies, "comm")
    assert rec["a"]["status"] == "pass" and rec["a"]["distributed_bridge"]["buckets"] > 1, rec["a"]
    assert rec["b"]["status"] == "pass" and rec["b"]["colocated_bridge"]["verified"], rec["b"]


@pytest.mark.slow
def test_parity_body_on_cpu(bodies):
    rec = _record(bodies, "parity")
    assert rec["status"] == "pass" and rec["fp32"]["rel"] <= 1e-5 and rec["bf16"]["rel"] <= 2e-2, rec


@pytest.mark.slow
def test_step_body_on_cpu(bodies):
    """The SD3.5-M step's path (bf16, distributed Adam, recompute none / full) with a 2-block, hidden-16 model of
    the same input shapes; CPU has no CUDA memory figures, so only the run itself is checked."""
    rec = _record(bodies, "step")
    for recompute, r in rec.items():
        assert r["recompute"] == recompute and r["spec"] == "local" and r["losses_finite"], r
        assert len(r["losses"]) == 3 and r["losses"][-1] < r["losses"][0], r
        assert set(r["phase_peak_over_steady_gib"]) == {"forward_backward", "optimizer_step"}, r
    assert rec["none"]["losses"] == rec["full"]["losses"]  # recompute changes memory, not numbers
    assert rec["full"]["predicted_gib"]["activations"] < rec["none"]["predicted_gib"]["activations"]


@pytest.mark.slow
def test_flux_lora_step_body_on_cpu(bodies):
    """The FLUX LoRA step's path (packed tokens, ids, guidance; rank-32 adapters on a frozen bf16 base) with
    megaflow's tiny FLUX config: only the adapters train, and they do (the loss moves; at the default lr and
    B = 0 four steps move it little)."""
    rec = _record(bodies, "flux_lora")
    assert rec["status"] == "fail" and rec["losses_finite"], rec  # no CUDA memory: the ratio is 0, out of bounds
    assert rec["tokens"] == {"image": 1024, "text": 512, "batch": 1}, rec
    assert 0 < rec["trained_params"] < rec["params"] / 2 and rec["losses"][-1] != rec["losses"][0], rec
    assert "LoRA adapters" in rec["predicted_gib"], rec


@pytest.mark.slow
def test_qwen_image_step_body_on_cpu(bodies):
    """The Qwen-Image step's path (packed tokens, the image grid's shape, no pooled text; full parameters, bf16,
    recompute) with megaflow's tiny Qwen-Image config at the check's token counts: every parameter trains and the
    loss moves; the plan's prediction is of this config, not of the 60-block table."""
    rec = _record(bodies, "qwen_image")
    assert rec["losses_finite"] and rec["trained_params"] == rec["params"] and rec["losses"][-1] != rec["losses"][0]
    assert rec["tokens"] == {"image": 1024, "text": 512, "batch": 1}, rec
    assert rec["predicted_gib"]["weights"] * 2**30 < 1e8, rec  # a tiny model's, not 20B parameters'


@pytest.mark.slow
def test_offload_body_on_cpu(bodies):
    """The offload check's path with the step test's tiny model: every moved storage comes back with the same
    checksum, the bytes moved are the plan's items of the tiny model's kind, and training goes on."""
    rec = _record(bodies, "offload")
    assert rec["status"] == "pass" and rec["exact_round_trip"] and rec["losses_finite"], rec
    assert len(rec["rounds"]) == 2 and len(rec["losses"]) == 4, rec
    for r in rec["rounds"]:
        assert r["offload_gib"]["states"] > 2 * r["offload_gib"]["weights"] > 0, r  # fp32 grads + Adam vs bf16
        assert r["reload_gib"] == pytest.approx(sum(r["offload_gib"].values())), r


def test_checksums_see_one_changed_bit():
    import torch

    from megaflow.testing.gpu.offload import checksums

    a = torch.randn(1000, dtype=torch.bfloat16)
    view = a[10:20]  # a view of the same storage is counted once
    before = checksums([a, view])
    assert len(before) == 1
    a.view(torch.int16)[500] ^= 1
    assert checksums([a]) != before


# The check's pretraining shrunk to the smallest the config allows that still evaluates and saves (64 renders,
# 2 steps of batch 8, one evaluation of 2 prompts), on one thread: the same path, ~1/10 of the check's work.
PRETRAIN_SMALL = ("pretrain.num_images=64", "pretrain.batch_size=8", "pretrain.max_steps=2", "pretrain.warmup_steps=1",
                  "pretrain.lr=5e-4", "pretrain.eval_every=2", "pretrain.eval_prompts=2", "pretrain.minutes=10",
                  "run.seed=3", "run.num_threads=1", 'model.spec="local"')


@pytest.mark.slow
def test_pretrain_parity_body_on_cpu():
    """The pretrain parity check's body with two CPU runs: seeded, the two DiT updates are bit-identical (the GPU
    check compares a CPU run with a CUDA run the same way), and the update is not empty."""
    rec = _body("import json\nfrom pathlib import Path\nfrom megaflow.testing.gpu import pretrain\n"
                f"print(json.dumps(pretrain.compare_devices(('cpu', 'cpu'), Path({str(REPO)!r}), "
                f"settings={PRETRAIN_SMALL!r})))", timeout=480)
    assert rec["status"] == "pass" and rec["update_rel_diff"] == 0.0 and rec["update_norm"] > 0, rec
    assert rec["loss"]["cpu_0"] == rec["loss"]["cpu_1"], rec
