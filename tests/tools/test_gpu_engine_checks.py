"""The CPU logic of the GPU engine checks and of the engine wheelhouse (megaflow.testing.gpu: throughput, engine,
sd35m, mirror, wheelhouse, run; tools/sgl_kernel_standin). Needs: CPU, no engine; one subprocess per stand-in import
(~2 s, torch). Checks:
- the throughput arithmetic against hand computations (model FLOPs of a small MMDiT, MFU, verl-omni's images/GPU/s);
- each check's record from given measurements (pass / fail), the log-prob comparison of the mirror check;
- the loop checks' settings are a valid config whose plan has a rollout and a training phase;
- a slimmed wheel drops exactly the matching files and its RECORD says so; the pins skip what the image has; what
  the GPU machine installs; the stand-in: refuses without CUDA, placeholders raise a clear error when used;
- ``--only engine`` expands to the engine checks, and the environment record lists the installed versions.
"""
from __future__ import annotations

import csv
import json
import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from megaflow.plan.dit import DiTDims
from megaflow.testing.gpu import engine, mirror, run, sd35m, throughput, wheelhouse

REPO = Path(__file__).resolve().parents[2]


def _dims(**kw) -> DiTDims:
    base = dict(family="sd3", source="test", hidden=4, heads=2, head_dim=2, blocks=2, single_blocks=0, dual_blocks=1,
                qk_norm=True, in_channels=2, out_channels=2, patch=1, joint_dim=3, pooled_dim=2, guidance_embeds=False,
                context_pre_only_last=True)
    return DiTDims(**{**base, **kw})


def test_sd3_forward_flops_by_hand():
    # embed 2*5*2*4 = 80, text 2*3*3*4 = 72, final 2*5*4*2 = 80; block 0 (dual): image 2*5*12*16 = 1920,
    # text 2*3*12*16 = 1152, joint attention 4*8*8*4 = 1024, dual 2*5*4*16 + 4*5*5*4 = 1040; block 1 (last):
    # image 1920, text (qkv only) 2*3*3*16 = 288, attention 1024
    assert throughput.forward_flops(_dims(), image=5, text=3) == 232 + 5136 + 3232
    assert throughput.train_step_flops(_dims(), 5, 3, batch=4) == 3 * 4 * 8600
    flux = _dims(family="flux", blocks=1, single_blocks=2, dual_blocks=0, context_pre_only_last=False)
    # embed 2*5*2*4 + 2*3*3*4 + 2*5*4*2 = 232; three blocks of 2*8*12*16 + 4*64*4 = 3072 + 1024
    assert throughput.forward_flops(flux, image=5, text=3) == 232 + 3 * 4096


def test_sd3_forward_flops_match_torch_flop_counter():
    """Against torch's own count of a diffusers SD3.5-style DiT's forward (matmuls, attention through SDPA's math
    path, which torch counts as its two batched products; the patch conv), which also counts the per-sample adaLN
    linears left out here (< 2% at 256 + 77 tokens)."""
    from diffusers import SD3Transformer2DModel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from megaflow.plan.dit import dims_from_config

    conf = dict(sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=3, attention_head_dim=32,
                num_attention_heads=2, joint_attention_dim=96, caption_projection_dim=64, pooled_projection_dim=32,
                pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm")
    dit = SD3Transformer2DModel(**conf).eval()
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        dit(hidden_states=torch.randn(1, 16, 32, 32), timestep=torch.tensor([500.0]),
            encoder_hidden_states=torch.randn(1, 77, 96), pooled_projections=torch.randn(1, 32))
    ours = throughput.forward_flops(dims_from_config("sd3", conf, "test"), image=256, text=77)
    assert ours == pytest.approx(counter.get_total_flops(), rel=0.02)


def test_mfu_and_images_per_gpu_second():
    assert throughput.peak_flops("NVIDIA H100 80GB HBM3") == throughput.peak_flops("NVIDIA H200") == 989e12
    assert throughput.peak_flops("NVIDIA H100 80GB HBM3", "fp32") is None and throughput.peak_flops("Some GPU") is None
    assert throughput.mfu(989e12, 2.0, 989e12) == 0.5 and throughput.mfu(1.0, 1.0, None) is None
    # verl-omni: batch x samples / (step seconds x GPUs): 32 prompts x 16 samples in 251 s on 4 GPUs = 0.51
    assert throughput.images_per_gpu_second(32, 16, 251.0, 4) == pytest.approx(0.51, abs=0.001)
    with pytest.raises(ValueError):
        throughput.images_per_gpu_second(1, 1, 0.0, 1)


def test_check_records_from_measurements():
    rec = sd35m.rollout_record({"sglang": [1.0, 2.0, 1.0], "diffusers": [2.0, 2.0, 2.0]})
    assert rec["images_per_s"] == {"sglang": 8.0, "diffusers": 4.0} and rec["sglang_over_diffusers"] == 2.0
    step = sd35m.step_record(_dims(), [0.5, 0.4, 0.6], 4, "none", "NVIDIA H100", 2**30)
    assert step["step_s"] == 0.5 and step["mfu"] == pytest.approx(3 * 4 * throughput.forward_flops(
        _dims(), 1024, 333) / 0.5 / 989e12)
    metrics = {"time/iteration_s": 4.0, "time/rollout_s": 1.0, "time/train_s": 2.5, "mem/cuda_alloc_mib_train": 2048.0}
    loop = sd35m.loop_record("nft", metrics, {"train": 2**31, "rollout": 2**30}, 2**31, 9.0)
    assert loop["images_per_gpu_s"] == 2.0 and loop["device_peak_vs_plan"] == 1.0, loop
    assert loop["trainer_cuda_gib"] == {"mem/cuda_alloc_mib_train": 2.0} and loop["phase_s"]["time/train_s"] == 2.5
    mib = 2**20
    good = engine.release_record(10 * mib, 500 * mib, 480 * mib, 499 * mib, 0.1, 0.2, same=True)
    assert good["status"] == "pass" and good["freed_mib"] == 20.0
    assert engine.release_record(10 * mib, 500 * mib, 499 * mib, 499 * mib, 0.1, 0.2, same=True)["status"] == "fail"
    lp = torch.tensor([[100.0, -50.0]], dtype=torch.float64)
    err = engine.logprob_errors(lp, lp + torch.tensor([[0.0, 1e-4]], dtype=torch.float64))
    assert err["max_abs"] == pytest.approx(1e-4) and err["rel"] == pytest.approx(1e-6)
    ok = {"rel": 1e-6, "finite": True}
    assert engine.sd3_record({"fp32": ok, "bf16": {"rel": 0.3, "finite": True}})["status"] == "pass"
    assert engine.sd3_record({"fp32": {"rel": 1e-3, "finite": True}})["status"] == "fail"


def test_mirror_comparison():
    ref = {k: torch.randn(5, 4) for k in ("log_probs", "latents", "model_outputs", "images")} | {"seeds": [1, 2]}
    assert mirror.compare_tensors(ref, dict(ref))["ok"]
    off = dict(ref, log_probs=ref["log_probs"] * (1 + 1e-3))
    res = mirror.compare_tensors(ref, off)
    assert not res["ok"] and not res["tensors"]["log_probs"]["ok"] and res["tensors"]["latents"]["identical"]
    assert not mirror.compare_tensors(ref, dict(ref, seeds=[1, 3]))["ok"]


@pytest.mark.parametrize("algo", ["nft", "flowgrpo"])
def test_loop_settings_are_a_config_with_two_phases(algo):
    from megaflow.config import load_config
    from megaflow.config.preflight import preflight
    from megaflow.plan.memory import plan

    sets = [*sd35m.LOOP_SETTINGS, *sd35m.ALGO_SETTINGS[algo]]
    cfg = load_config(REPO / "configs/cpu_demo.toml", [*sets, "model.pretrained=no-such-dir"])
    assert cfg.algo.name == algo and cfg.train.offload == "optimizer" and cfg.rollout.num_steps == sd35m.STEPS
    preflight(cfg, "show", files=False)  # megaflow train's checks, but those of the files it names (the
    # pipeline is built on the GPU machine, as the loop check names it) and of this machine's devices
    (group,) = plan(cfg, gpus=1, gpu_mem_gib=80)["groups"]
    assert set(group.phases) == {"train", "rollout"} and group.phases["rollout"] < group.phases["train"]


def _wheel(path: Path, files: dict[str, bytes]) -> Path:
    record = "pkg-1.0.dist-info/RECORD"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(record, "".join(f"{n},sha256=x,{len(d)}\n" for n, d in files.items()) + f"{record},,\n")
    return path


def test_slim_wheel_drops_matching_files_and_rewrites_record(tmp_path):
    files = {"pkg/__init__.py": b"x = 1\n", "pkg/ext/_big.so": b"\0" * 1000, "pkg/test/test_a.py": b"",
             "pkg-1.0.dist-info/METADATA": b"Name: pkg\n"}
    out, dropped = wheelhouse.slim_wheel(_wheel(tmp_path / "pkg-1.0-py3-none-any.whl", files), tmp_path / "out",
                                         ["pkg/ext/*.so", "pkg/test/*"])
    assert sorted(dropped) == ["pkg/ext/_big.so", "pkg/test/test_a.py"]
    with zipfile.ZipFile(out) as z:
        assert z.read("pkg/__init__.py") == b"x = 1\n"
        rows = list(csv.reader(io.StringIO(z.read("pkg-1.0.dist-info/RECORD").decode())))
        assert sorted(z.namelist()) == sorted(r[0] for r in rows)
    assert {r[0] for r in rows} == {"pkg/__init__.py", "pkg-1.0.dist-info/METADATA", "pkg-1.0.dist-info/RECORD"}
    assert rows[0][1] == wheelhouse._record_hash(b"x = 1\n")


def test_pins_skip_what_the_image_has_and_wanted_only_what_is_missing(tmp_path):
    image = {"pydantic": "2.0", "psutil": None}
    pins = wheelhouse.pins(REPO / "pyproject.toml", image, lambda d: "9.9")
    assert pins[:3] == ["megatron-core==0.19.2", "sglang==0.5.23", "diffusers==0.37.0"]
    assert "pyzmq==9.9" in pins and not any(p.startswith(("pydantic==", "psutil")) for p in pins)
    for name in ("megatron_core-0.19.2-py3-none-any.whl", "sglang-0.5.23-cp312.whl", "pyzmq-27-cp312.whl"):
        (tmp_path / name).write_bytes(b"")
    install, absent = wheelhouse.wanted(tmp_path, can_import=lambda m: m != "zmq" and m != "orjson",
                                        version_of=lambda d: "1.0")
    assert install == ["megatron_core", "sglang", "pyzmq"]
    assert set(absent) == {"diffusers", "megaflow", "megaflow_sgl_kernel_standin", "orjson"}
    install, _ = wheelhouse.wanted(tmp_path, can_import=lambda m: True, version_of=lambda d: "0.30.1")
    assert install == ["megatron_core", "sglang"]  # huggingface_hub 0.30 < 0.34 wanted, but no wheel here


def _standin(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO / "tools/sgl_kernel_standin"),
                               "CUDA_VISIBLE_DEVICES": "", **env})


def test_standin_refuses_without_cuda_and_raises_when_used(tmp_path):
    log = tmp_path / "standin.log"
    refused = _standin("import sgl_kernel", SGL_KERNEL_STANDIN_LOG=str(log))
    assert refused.returncode != 0 and "ImportError" in refused.stderr and "refused sgl_kernel" in log.read_text()
    forced = _standin(
        "from sgl_kernel import rmsnorm\nimport sgl_kernel\nassert sgl_kernel.STANDIN\n"
        "try:\n    import sgl_kernel.flash_attn\nexcept ModuleNotFoundError:\n    print('no submodule')\n"
        "rmsnorm(1)", SGL_KERNEL_STANDIN_FORCE="1", SGL_KERNEL_STANDIN_LOG=str(log))
    assert "no submodule" in forced.stdout, forced.stderr
    assert "SglKernelUnavailable: sgl_kernel.rmsnorm is a kernel of sgl_kernel" in forced.stderr
    assert "lookup sgl_kernel.rmsnorm" in log.read_text()
    wheel = wheelhouse.standin_wheel(REPO / "tools/sgl_kernel_standin", tmp_path / "wheels")
    assert "sgl_kernel/__init__.py" in zipfile.ZipFile(wheel).namelist()


def test_only_groups_and_installed_versions():
    assert run.expand_only(["engine"]) == run.GROUPS["engine"] and "sd35m_loop_nft" in run.GROUPS["engine"]
    assert run.expand_only(["nccl", "engine_sd3"]) == ["nccl", "engine_sd3"] and run.expand_only([]) is None
    assert run.expand_only(["sd35m_rollout", "engine"])[:2] == ["sd35m_rollout", "engine_sd3"]  # given order, once
    assert len(run.expand_only(["sd35m_rollout", "engine"])) == len(run.GROUPS["engine"])
    assert set(run.GROUPS["trainer"]) | set(run.GROUPS["engine"]) == set(run.CHECKS)
    with pytest.raises(SystemExit):
        run.expand_only(["no_such_check"])
    rec = run.installed_versions()
    assert rec["versions"]["torch"] == torch.__version__.split("+")[0] or rec["versions"]["torch"] == torch.__version__
    assert any(p.lower().startswith("torch==") for p in rec["packages"])


def test_mirror_record_names_wheels_without_paths(tmp_path):
    (tmp_path / "a-1-py3-none-any.whl").write_bytes(b"12345")
    log = tmp_path / "install.log"
    log.write_text("pip 25\ninstall: megaflow sglang pyzmq (from /x/gpu_wheels into /tmp/site)\n")
    rec = mirror.wheelhouse_record(str(tmp_path), str(log))
    assert rec == {"wheel_bytes": {"a-1-py3-none-any.whl": 5}, "wheelhouse_total_bytes": 5,
                   "installed": ["megaflow", "sglang", "pyzmq"]}


# The engine checks' bodies (fp32 engines on CPU) and the SD3.5-M train step's (a 2-block, hidden-16 DiT of its
# input widths), one after another in one interpreter: they share its imports (torch, megatron, diffusers, SGLang;
# ~15 s a process), and each starts and stops its own engines and megatron world.
BODIES = """import json, sys, traceback, torch, megaflow
from pathlib import Path
from megaflow.plan.dit import BUILTIN
from megaflow.testing.gpu import engine, sd35m
root, cpu = Path(sys.argv[1]), torch.device('cpu')
conf = dict(BUILTIN['sd3'][1], num_layers=2, attention_head_dim=8, num_attention_heads=2,
            caption_projection_dim=16, dual_attention_layers=[0])
bodies = {
    'sd3': lambda: {**engine.sd3_logprobs_body(cpu, root / 'a', precisions=('fp32',)),
                    'sync': engine.sync_body(cpu, root / 'b')},
    'flux': lambda: engine.flux_body(root / 'c', 'fp32'),
    'train_step': lambda: sd35m.train_step_body(cpu, conf, 2, 'full', 'cpu'),
}

def record(body):
    try:
        return body()
    except Exception:
        return {'error': traceback.format_exc()}

if __name__ == '__main__':
    print(json.dumps({name: record(body) for name, body in bodies.items()}))
"""


@pytest.fixture(scope="module")
def bodies(tmp_path_factory) -> dict:
    """Each body's record by name (a body that raised: {"error": its traceback}); ~2 min."""
    proc = subprocess.run([sys.executable, "-c", BODIES, str(tmp_path_factory.mktemp("bodies"))], cwd=REPO,
                          capture_output=True, text=True, timeout=1500,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _record(bodies: dict, name: str) -> dict:
    rec = bodies[name]
    assert "error" not in rec, rec["error"]
    return rec


@pytest.mark.slow
@pytest.mark.engine
def test_sd3_logprob_and_sync_check_bodies_on_cpu(bodies):
    """``engine_sd3``'s body with a CPU engine (fp32): the trainer's recompute (megatron DiT + flow math) matches the
    engine's rollout log-probs within the GPU check's tolerance, and its velocities the engine's; ``engine_sync``'s
    body: the pushed weights verified, the engine's checksum theirs, the images changed."""
    rec = _record(bodies, "sd3")
    assert rec["status"] == "pass" and rec["fp32"]["rel"] <= engine.TOLERANCE["fp32"], rec
    assert rec["fp32"]["velocity_max_abs"] < 1e-4 and rec["fp32"]["samples"] == 4, rec
    sync = rec["sync"]  # engine_sync's body: the shared-memory bridge through shared memory on CPU
    assert sync["status"] == "pass" and sync["verified"] and sync["checksum_is_pushed_weights"], sync
    assert sync["buckets"] > 1 and sync["image_change_max"] > 1e-3, sync


def test_prepared_engine_run_skips_without_cuda_and_packs_its_logs(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(tmp_path),
           "GPU_WHEELS": str(tmp_path / "no-wheels"), "GPU_CHECK_ONLY": "engine", "GPU_CHECK_PACK": "1"}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.jsonl", "gpu_check_summary.txt", "install.log",
                                                     "logs.tgz"]
    records = [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]
    assert [r["check"] for r in records] == ["env", *run.GROUPS["engine"]]
    assert all(r["status"] == "skipped" and "no CUDA" in r["reason"] for r in records[1:]), records
    assert records[0]["versions"]["torch"] and records[0]["packages"]


FAKE_CUDA = """
import types, torch
props = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, total_memory=140 * 2**30,
                              multi_processor_count=132, uuid="fake", gcnArchName="")
torch.cuda.is_available = lambda: True
torch.version.cuda = "13.0"
torch.cuda.get_device_name = lambda *a, **k: props.name
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
torch.cuda.get_device_properties = lambda *a, **k: props
torch.cuda.device_count = lambda: 1
torch.cuda.current_device = lambda: 0
"""
"""torch made to report an H200 (no CUDA call is made by an import): sglang then takes its CUDA import paths."""
ENGINE_IMPORTS = ("megaflow.rollout.sglang.server", "megaflow.rollout.sglang.engine", "megaflow.rollout.sglang.plugin",
                  "megaflow.rollout.sglang.weights", "sglang.multimodal_gen.runtime.layers.activation",
                  "sglang.multimodal_gen.runtime.models.dits.stablediffusion3",
                  "sglang.multimodal_gen.runtime.models.dits.flux", "sglang.multimodal_gen.runtime.models.encoders.t5",
                  "sglang.multimodal_gen.runtime.models.encoders.clip")


@pytest.mark.slow  # ~20-40 s: imports sglang
def test_standin_lets_the_engines_cuda_time_imports_succeed(tmp_path):
    """With torch faked as CUDA (sglang's layers, quantization and KV-cache modules then import sgl_kernel's names
    and two of its submodules unguarded), megaflow's engine modules and the SD3 / FLUX models and encoders import
    against the stand-in, which hands out placeholders for exactly what they import (on an H200 the engine's import
    failed on ``sgl_kernel.quantization`` before the stand-in had it)."""
    log = tmp_path / "standin.log"
    proc = _standin(FAKE_CUDA + "import importlib, megaflow\n"
                    f"for m in {ENGINE_IMPORTS!r}:\n    importlib.import_module(m)\nprint('imported')",
                    SGL_KERNEL_STANDIN_FORCE="1", SGL_KERNEL_STANDIN_LOG=str(log))
    assert "imported" in proc.stdout, proc.stderr[-3000:]
    looked_up = {line.split()[2] for line in log.read_text().splitlines() if line.split()[1] == "lookup"}
    assert {"sgl_kernel.rmsnorm", "sgl_kernel.fused_add_rmsnorm", "sgl_kernel.quantization.ggml_dequantize"} \
        <= looked_up, looked_up
    namespaces = {"sgl_kernel", "sgl_kernel.quantization", "sgl_kernel.kvcacheio"}  # the stand-in's and its submodules'
    assert all(n.rsplit(".", 1)[0] in namespaces for n in looked_up), looked_up


@pytest.mark.slow
@pytest.mark.engine
def test_loop_check_body_on_cpu(tmp_path, tiny_sd3_dir):
    """The loop check's path (``megaflow train`` with the check's settings, its --json metrics, the plan, the
    record) with the tiny SD3 pipeline on CPU: fp32, 64 px, 4 steps, 2 iterations of NFT."""
    extra = ("rollout.precision=fp32", "model.dtype=float32", "rollout.height=64", "rollout.width=64",
             "rollout.num_steps=4", "train.iterations=2", "run.num_threads=1")
    rec = sd35m.loop_body("nft", tiny_sd3_dir, REPO / "configs/cpu_demo.toml", extra)
    assert rec["status"] == "pass" and rec["algo"] == "nft" and rec["iteration_s"] > 0, rec
    assert rec["images_per_gpu_s"] == pytest.approx(2 * 4 / rec["iteration_s"]), rec
    assert {"time/rollout_s", "time/train_s"} <= set(rec["phase_s"]), rec
    assert set(rec["planned_gib"]) == {"train", "rollout"}, rec


def test_sd35m_pipeline_widths_fit_the_dit():
    from megaflow.plan.dit import BUILTIN

    conf = BUILTIN["sd3"][1]
    clip_l, clip_g, t5 = sd35m.ENCODER_WIDTHS
    assert clip_l + clip_g == conf["pooled_projection_dim"] and t5 == conf["joint_attention_dim"]
    assert sd35m.VAE["latent_channels"] == conf["in_channels"] and 2 ** (len(sd35m.VAE["block_out_channels"]) - 1) == 8


@pytest.mark.slow  # ~20-60 s
def test_sd35m_pipeline_builder_makes_a_pipeline_diffusers_samples(tmp_path):
    """``build_pipeline`` with small shapes on CPU: diffusers loads what it saved and samples a 64 px image."""
    from diffusers import StableDiffusion3Pipeline

    dit = dict(sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
               num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=32, pooled_projection_dim=64,
               pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm")
    vae = dict(sd35m.VAE, block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=8, sample_size=64)
    sd35m.build_pipeline(tmp_path / "p", dit, vae, (32, 32, 64), "cpu")
    pipe = StableDiffusion3Pipeline.from_pretrained(tmp_path / "p", torch_dtype=torch.float32)
    image = pipe(prompt="a red cat", num_inference_steps=2, height=64, width=64, guidance_scale=1.0,
                 output_type="pt").images
    assert image.shape == (1, 3, 64, 64) and torch.isfinite(image).all()


@pytest.mark.slow
@pytest.mark.engine
def test_flux_check_body_on_cpu(bodies):
    """``engine_flux``'s body in fp32 on CPU: finite FLUX trajectories, log-probs equal to the flow math on the
    engine's velocities."""
    rec = _record(bodies, "flux")
    assert rec["status"] == "pass" and rec["finite"] and rec["rel"] <= 1e-5 and rec["samples"] == 4, rec


@pytest.mark.slow  # a megatron world of one (the shared interpreter also starts the engine bodies' engines)
@pytest.mark.engine
def test_train_step_check_body_on_cpu(bodies):
    """``sd35m_train_step``'s path (bf16, distributed Adam, a batch of 1024 + 333 tokens; 2 here) with a 2-block,
    hidden-16 DiT of SD3.5-M's input widths: the losses are finite and fall; no MFU without a known device."""
    rec = _record(bodies, "train_step")
    assert rec["status"] == "pass" and len(rec["losses"]) == 1 + sd35m.TIMED and rec["mfu"] is None, rec
    assert rec["losses"][-1] < rec["losses"][0] and rec["batch"] == 2 and rec["model_tflops_per_step"] > 0, rec
    assert rec["forward_backward_s"] > 0 and rec["optimizer_s"] > 0 and rec["mfu_forward_backward"] is None, rec
    assert rec["optimizer_classes"] == ["torch.optim.adamw.AdamW"] and "optimizer_fused_s" not in rec, rec  # CPU
