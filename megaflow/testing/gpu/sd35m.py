"""GPU checks of the SD3.5-Medium RL throughput table: random weights at the real shapes, 512 px, 10 steps, bf16,
one GPU, CFG-free rollouts.

Invariant: the pipeline is built once per machine (real DiT and VAE, 2-layer text encoders at the real widths).
Design notes: docs/design/testing.md.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from megaflow.testing.gpu import throughput
from megaflow.testing.gpu.common import Skip, error_summary, require_cuda, require_module
from megaflow.testing.gpu.engine import ENGINE_ENV

HEIGHT = WIDTH = 512
STEPS, BATCH, TIMED = 10, 8, 3
VAE = dict(in_channels=3, out_channels=3, latent_channels=16, down_block_types=("DownEncoderBlock2D",) * 4,
           up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
           norm_num_groups=32, sample_size=1024, shift_factor=0.0609, scaling_factor=1.5305, use_quant_conv=False,
           use_post_quant_conv=False)
"""SD3's VAE (stabilityai/stable-diffusion-3.5-medium vae/config.json)."""
LOOP_SETTINGS = ["rollout.height=512", "rollout.width=512", f"rollout.num_steps={STEPS}", "rollout.precision=bf16",
                 "rollout.group_size=4", "rollout.prompts_per_iter=2", "rollout.max_batch_outputs=8",
                 "rollout.guidance_scale=1.0", "model.dtype=bfloat16", "train.micro_batch_size=4",
                 "train.offload=optimizer", "train.iterations=3", "bridge.mode=shared_memory", "run.num_threads=8",
                 "parallel.tp=1", "rollout.attention_backend=torch_sdpa"]
"""``--set`` overrides of the loop checks on configs/cpu_demo.toml (its reward: color_target, cheap)."""
ALGO_SETTINGS = {"nft": ["algo.name=nft", "rollout.sde_type=ode"], "flowgrpo": ["algo.name=flowgrpo"]}
"""Per algorithm (DiffusionNFT trains on ODE samples; FlowGRPO keeps cpu_demo's SDE rollouts)."""


ENCODER_WIDTHS = (768, 1280, 4096)
"""CLIP-L, CLIP-G and T5-XXL widths: SD3 concatenates the CLIPs' pooled outputs (768 + 1280 = the DiT's
pooled_projection_dim) and pads their hidden states to T5's width (the DiT's joint_attention_dim)."""


def pipeline_dir() -> Path:
    """The SD3.5-M-shaped pipeline (bf16 safetensors), built once under $TMPDIR and reused by every check."""
    from megaflow.plan.dit import BUILTIN

    out = Path(tempfile.gettempdir()) / "megaflow-sd35m-pipeline"
    if not (out / ".complete").is_file():
        build_pipeline(out, BUILTIN["sd3"][1], VAE, ENCODER_WIDTHS, "cuda")
        (out / ".complete").write_text("")
    return out


def build_pipeline(out: Path, dit_conf: dict, vae_conf: dict, widths: tuple[int, int, int], device: str) -> Path:
    """A StableDiffusion3Pipeline of random weights: DiT and VAE at ``dit_conf`` / ``vae_conf`` (made on ``device``,
    saved in bf16), 2-layer text encoders of ``widths`` (fp32); the CPU test builds a small one and samples it."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, \
        StableDiffusion3Pipeline

    from megaflow.models import tiny_pipeline as tp

    torch.manual_seed(0)
    with torch.device(device):
        dit = SD3Transformer2DModel(**dit_conf).to(torch.bfloat16)
        vae = AutoencoderKL(**vae_conf).to(torch.bfloat16)
    toks = [tp.make_clip_tokenizer(), tp.make_clip_tokenizer(), tp.make_t5_tokenizer()]
    pipe = StableDiffusion3Pipeline(
        transformer=dit.eval(), vae=vae.eval(), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        text_encoder=tp.make_clip_encoder(toks[0], hidden=widths[0], seed=2, with_projection=True),
        text_encoder_2=tp.make_clip_encoder(toks[1], hidden=widths[1], seed=3, with_projection=True),
        text_encoder_3=tp.make_t5_encoder(toks[2], d_model=widths[2], seed=4),
        tokenizer=toks[0], tokenizer_2=toks[1], tokenizer_3=toks[2])
    pipe.save_pretrained(out, safe_serialization=True)
    return out


def _needs(*modules: str) -> None:
    require_cuda()
    for m in ("megatron.core", "diffusers", *modules):
        require_module(m)


def _timed_calls(call, sync) -> list[float]:
    """Seconds of ``TIMED`` calls after one warm-up call."""
    call()
    times = []
    for _ in range(TIMED):
        sync()
        t0 = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def sd35m_rollout() -> dict:
    """SGLang engine vs diffusers' pipeline, images/s at batch ``BATCH``."""
    _needs("sglang")
    import torch

    from megaflow.rollout.types import RolloutRequest
    from megaflow.testing.gpu.engine import start_engine

    path, out = pipeline_dir(), {}
    engine = start_engine(path, precision="bf16", engine_id="sd35m")
    try:
        req = [RolloutRequest(prompt="a red cat", num_outputs=BATCH, seed=1, num_steps=STEPS, height=HEIGHT,
                              width=WIDTH)]
        out["sglang"] = _timed_calls(lambda: engine.generate(req), torch.cuda.synchronize)
    finally:
        engine.shutdown()
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(path, torch_dtype=torch.bfloat16).to("cuda")
    gen = torch.Generator("cuda").manual_seed(1)
    out["diffusers"] = _timed_calls(lambda: pipe(prompt=["a red cat"] * BATCH, num_inference_steps=STEPS, height=HEIGHT,
                                                 width=WIDTH, guidance_scale=1.0, generator=gen, output_type="pt"),
                                    torch.cuda.synchronize)
    return rollout_record(out)


def rollout_record(times: dict[str, list[float]]) -> dict:
    """images/s per sampler (median call), and SGLang's over diffusers' (the target: >= 1.2)."""
    rates = {k: throughput.images_per_second(BATCH, statistics.median(v)) for k, v in times.items()}
    ratio = rates["sglang"] / rates["diffusers"]
    return {"status": "pass", "precision": "bf16", "batch": BATCH, "steps": STEPS, "size": [HEIGHT, WIDTH],
            "cfg": False, "call_s": times, "images_per_s": rates, "sglang_over_diffusers": round(ratio, 3),
            "target_ratio": 1.2, "meets_target": ratio >= 1.2,
            "headline": f"SGLang {rates['sglang']:.2f} vs diffusers {rates['diffusers']:.2f} images/s "
                        f"(x{ratio:.2f}, target 1.2), bf16, batch {BATCH}, {STEPS} steps, 512 px"}


def sd35m_train_step() -> dict:
    """Trainer step at batch 4 (bf16, distributed Adam): seconds and MFU."""
    _needs()
    import torch

    from megaflow.plan.dit import BUILTIN

    props = torch.cuda.get_device_properties(0)
    recompute = "none" if props.total_memory > 100 * 2**30 else "full"  # batch 4 without recompute needs ~75 GiB
    return train_step_body(torch.device("cuda", 0), BUILTIN["sd3"][1], 4, recompute, props.name)


def train_step_body(dev, conf: dict, batch: int, recompute: str, device_name: str) -> dict:
    """``sd35m_train_step``'s body: the step check's trainer (megaflow.testing.gpu.model) for diffusers config
    ``conf``, a random rectified-flow batch of 1024 image + 333 text tokens; the CPU test runs a tiny ``conf``."""
    import torch

    import megaflow  # noqa: F401
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import destroy_distributed, init_distributed
    from megaflow.plan.dit import dims_from_config
    from megaflow.testing.gpu import model
    from megaflow.trainer.runner import rectified_flow_microbatch

    cuda = dev.type == "cuda"
    init_distributed(ParallelDims(), seed=0)
    try:
        trainer, _ = model._trainer(recompute, conf)
        g = torch.Generator(device=dev).manual_seed(0)
        x0, noise = (torch.randn(batch, conf["in_channels"], 64, 64, device=dev, generator=g) for _ in range(2))
        ehs = torch.randn(batch, 333, conf["joint_attention_dim"], device=dev, generator=g, dtype=torch.bfloat16)
        pooled = torch.randn(batch, conf["pooled_projection_dim"], device=dev, generator=g, dtype=torch.bfloat16)
        mb = rectified_flow_microbatch(x0, noise, torch.full((batch,), 0.5, device=dev), ehs, pooled)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        losses, sync = [], torch.cuda.synchronize if cuda else (lambda: None)
        times = _timed_calls(lambda: losses.append(float(trainer.train_step([mb])["loss"])), sync)
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        split = step_split(trainer, mb, sync)
    finally:
        destroy_distributed()
    dims = dims_from_config("sd3", conf, "check")
    rec = step_record(dims, times, batch, recompute, device_name, peak)
    finite = all(loss == loss and abs(loss) < float("inf") for loss in losses)
    util = throughput.mfu(throughput.train_step_flops(dims, 1024, 333, batch), split["forward_backward_s"],
                          throughput.peak_flops(device_name))
    return {**rec, **split, "mfu_forward_backward": util, "status": "pass" if finite else "fail", "losses": losses}


def step_split(trainer, mb: dict, sync) -> dict:
    """Where a step's time goes: forward + backward alone, the optimizer step alone (its class named), and, where
    it is torch's AdamW (megatron's fallback without Transformer Engine or apex; megaflow runs it ``foreach``), the
    same step with ``fused=True`` (measured only: the trainer's step is unchanged; an error of that variant is
    recorded, not raised). Median seconds of ``TIMED``."""
    import torch

    from megaflow.testing.gpu.common import error_line
    from megaflow.trainer.offload import inner_torch_optimizers
    from megaflow.trainer.runner import rectified_flow_loss

    def forward_backward():
        trainer.optimizer.zero_grad()
        trainer.forward_backward([mb], rectified_flow_loss)

    out = {"forward_backward_s": statistics.median(_timed_calls(forward_backward, sync)),
           "optimizer_s": statistics.median(_timed_calls(trainer.optimizer.step, sync))}
    inner = inner_torch_optimizers(trainer.optimizer)
    out["optimizer_classes"] = sorted({f"{type(o).__module__}.{type(o).__name__}" for o in inner})
    adams = [o for o in inner if isinstance(o, torch.optim.AdamW)]
    if adams and all(p.is_cuda for o in adams for g in o.param_groups for p in g["params"]):
        for g in (g for o in adams for g in o.param_groups):
            g.update(fused=True, foreach=False)
        try:
            out["optimizer_fused_s"] = statistics.median(_timed_calls(trainer.optimizer.step, sync))
        except Exception as e:  # noqa: BLE001 - the variant is optional; the step's own figures stand
            out["optimizer_fused_error"] = error_line(e)
    return out


def step_record(dims, times: list[float], batch: int, recompute: str, device: str, peak_bytes: int) -> dict:
    step_s = statistics.median(times)
    flops = throughput.train_step_flops(dims, 1024, 333, batch)
    util = throughput.mfu(flops, step_s, throughput.peak_flops(device))
    return {"status": "pass", "precision": "bf16", "batch": batch, "recompute": recompute, "tokens": [1024, 333],
            "step_s_all": times, "step_s": step_s, "model_tflops_per_step": flops / 1e12, "mfu": util,
            "target_mfu": 0.4, "peak_gib": peak_bytes / 2**30, "device": device,
            "headline": f"batch {batch} step {step_s * 1000:.0f} ms, {flops / 1e12:.1f} model TFLOP, MFU "
                        f"{'n/a' if util is None else f'{util:.1%}'} (target 40%), recompute {recompute}"}


class _DevicePeak:
    """Polls device memory in use (every process on the GPU) from a thread; ``peak`` over the baseline."""

    def __init__(self):
        import torch

        torch.cuda.init()
        self.base, self.peak, self._stop = self._used(), 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    @staticmethod
    def _used() -> int:
        import torch

        free, total = torch.cuda.mem_get_info()
        return total - free

    def _poll(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self._used() - self.base)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def loop(algo: str) -> dict:
    """``megaflow train`` (this algorithm) on the SD3.5-M pipeline; its last iteration's metrics and the plan."""
    _needs("sglang")
    config = Path.cwd() / "configs" / "cpu_demo.toml"  # gpu_check.sh runs from the checkout's root
    if not config.is_file():
        raise Skip(f"no {config} (run from the repository's root)")
    return loop_body(algo, pipeline_dir(), config)


def loop_body(algo: str, pipeline: Path, config: Path, extra: tuple[str, ...] = ()) -> dict:
    """``loop``'s body: ``megaflow train -c config`` with ``LOOP_SETTINGS`` (then ``extra``) on ``pipeline``, in
    its own process; device memory polled while it runs (CUDA only). The CPU test runs a tiny pipeline through it."""
    import torch

    from megaflow.config import load_config
    from megaflow.plan.memory import plan

    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as runs:
        sets = [*LOOP_SETTINGS, *ALGO_SETTINGS[algo], f"model.pretrained={pipeline}", f"run.output_dir={runs}",
                f"run.name=loop-{algo}", *extra]
        args = ["-c", str(config), *(x for s in sets for x in ("--set", s))]
        peak = _DevicePeak() if cuda else None
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "megaflow.cli", "train", *args, "--json"], capture_output=True,
                              text=True, env={**os.environ, **ENGINE_ENV})
        wall, device_peak = time.perf_counter() - t0, peak.stop() if peak else 0
        if proc.returncode != 0:
            _log_failed_run(proc.stderr, Path(runs))
            raise RuntimeError(f"megaflow train exited {proc.returncode}: {error_summary(proc.stderr)}")
        rows = [json.loads(line) for f in Path(runs).glob("*/metrics.jsonl") for line in f.read_text().splitlines()]
    metrics = json.loads(proc.stdout.strip().splitlines()[-1])
    sync = sync_record(rows, torch.device("cuda", 0) if cuda else torch.device("cpu"))
    cfg = load_config(config, [s for s in sets if not s.startswith("run.output_dir=")])
    memory = torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else 80.0
    (group,) = plan(cfg, gpus=1, gpu_mem_gib=memory)["groups"]
    return {**loop_record(algo, metrics, group.phases or {"total": group.total}, device_peak, wall,
                          prompts=cfg.rollout.prompts_per_iter, group_size=cfg.rollout.group_size), "sync": sync}


def sync_record(rows: list[dict], device) -> dict:
    """The run's weight syncs (``sync/seconds`` of every metrics row): the first and the steady ones apart, and the
    steady sync's GB/s against a copy of the same bytes on ``device`` (``pushes.push_record``)."""
    from megaflow.testing.gpu.pushes import copy_seconds, push_record

    seconds = [r["sync/seconds"] for r in rows if "sync/seconds" in r]
    if len(seconds) < 2:
        return {"status": "skipped", "reason": f"{len(seconds)} sync(s) in the run's metrics: need 2"}
    nbytes = int(rows[-1]["sync/mbytes"] * 2**20)
    return {"mbytes": round(nbytes / 2**20, 1), **push_record(seconds, nbytes, copy_seconds(nbytes, device))}


def _log_failed_run(stderr: str, runs: Path, lines: int = 200) -> None:
    """Into this check's log (stderr): the tail of ``megaflow train``'s stderr and of every log of its run dir
    (the engines' among them), which go with the temporary run dir."""
    print(f"--- megaflow train stderr (last {lines} lines)", *stderr.splitlines()[-lines:], sep="\n", file=sys.stderr)
    for log in sorted(runs.rglob("*.log")):
        text = log.read_text(errors="replace").splitlines()[-lines:]
        print(f"--- {log.relative_to(runs)} (last {lines} lines)", *text, sep="\n", file=sys.stderr)


def loop_record(algo: str, metrics: dict, planned: dict, device_peak: int, wall_s: float, prompts: int = 2,
                group_size: int = 4) -> dict:
    """Per-phase seconds and memory of the last iteration against the plan; verl-omni's images/GPU/s."""
    gib, mib = 2**30, 2**20
    step_s = float(metrics["time/iteration_s"])
    rate = throughput.images_per_gpu_second(prompts, group_size, step_s, gpus=1)
    phases = {k: metrics[k] for k in ("time/rollout_s", "time/train_s", "colocate/switch_seconds", "offload/seconds",
                                      "reload/seconds") if k in metrics}
    memory = {k: v / 1024 for k, v in metrics.items() if k.startswith("mem/cuda")}  # MiB -> GiB
    planned_gib = {k: v / gib for k, v in planned.items()}
    ratio = device_peak / max(planned.values()) if planned else None
    return {"status": "pass", "algo": algo, "iterations": int(metrics.get("iteration", 0)) or None,
            "prompts": prompts, "group_size": group_size, "iteration_s": step_s, "phase_s": phases,
            "images_per_gpu_s": rate, "trainer_cuda_gib": memory, "device_peak_gib": device_peak / gib,
            "planned_gib": planned_gib, "device_peak_vs_plan": None if ratio is None else round(ratio, 3),
            "wall_s": round(wall_s, 1), "device_peak_mib": device_peak / mib,
            "headline": f"{algo}: {rate:.3f} images/GPU/s (iteration {step_s:.1f} s: rollout "
                        f"{phases.get('time/rollout_s', float('nan')):.1f} s, train "
                        f"{phases.get('time/train_s', float('nan')):.1f} s); device peak {device_peak / gib:.1f} GiB "
                        f"vs plan {max(planned_gib.values(), default=float('nan')):.1f}"}


def sd35m_loop_nft() -> dict:
    return loop("nft")


def sd35m_loop_flowgrpo() -> dict:
    return loop("flowgrpo")
