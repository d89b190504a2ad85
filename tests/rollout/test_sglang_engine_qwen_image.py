"""Qwen-Image through SGLang's own Qwen-Image pipeline on CPU (needs: engine; one engine and one in-process LoRA
trainer shared by the module, ~2-3 min).

The tiny QwenImagePipeline (tests/tools: it loads in diffusers) runs SGLang's native pipeline (the card's
``sglang_model_id``): SDE / CPS / ODE rollouts with per-step log-probs, with CFG off and with Qwen-Image's true CFG
and a negative prompt. Checks, fp32:
- the engine's log-probs recompute from its own velocities with megaflow's flow math (1e-6 abs);
- its velocities equal diffusers' QwenImageTransformer2DModel on the trajectory's states and conditioning, CFG
  combined as QwenImagePipeline does (guided, then each token rescaled to the conditional norm) (1e-5);
- the megatron trainer's recomputed log-probs (microbatches from the family's ``batch_conditioning``) equal the
  engine's within 1e-5 relative, CFG off and on; control: CFG recomputed without the rescale is off by > 1e-4;
- the bridge: full weights (shared-memory buckets) and LoRA adapters reach the engine verified by checksum, and the
  trainer's log-probs equal the engine's after each push (the stale engine before it differs by > 1e-3).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import megaflow  # noqa: F401  (import guards before sglang/megatron)
from megaflow.flow.step import config_for_step, sigma_max_of, transition_log_prob
from megaflow.rollout.types import RolloutRequest
from megaflow.testing.reference import sde_step_indices, transition_config
import megaflow.rollout.sglang as sglang_engine

pytestmark = [pytest.mark.engine, pytest.mark.slow]
RANK, ALPHA, SIZE = 4, 8.0, 32
PROMPTS = ("a red cat", "two blue squares on a big house")  # different text lengths: merged with a text mask
KINDS = {"sde": dict(sde_type="sde", sde_step_indices=[0, 1]),
         "cps": dict(sde_type="cps", noise_level=0.8, log_prob_no_const=True, sde_step_indices=[1, 2]),
         "ode": dict(sde_type="ode")}
CFG = dict(do_cfg=True, guidance_scale=4.0, negative_prompt="blue")


@pytest.fixture(scope="module")
def pipeline(tiny_pipeline_tool, tmp_path_factory) -> Path:
    return tiny_pipeline_tool.make_tiny_pipeline("qwen_image", tmp_path_factory.mktemp("qwen") / "tiny", seed=0)


@pytest.fixture(scope="module")
def engine(pipeline):
    torch.set_num_threads(1)
    eng = sglang_engine.SGLangEngine(sglang_engine.SGLangEngineConfig(
        model_path=str(pipeline), family="qwen_image", engine_id="qwen0", num_threads=1))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def trainer(pipeline):
    """The run's LoRA trainer (``build_trainer``, model.family = "qwen_image", TP=1) in this process."""
    from megaflow.config import load_config
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import destroy_distributed, init_distributed
    from megaflow.run.build import build_trainer

    init_distributed(ParallelDims(), seed=0)
    cfg = load_config(None, ['model.family="qwen_image"', f"lora.rank={RANK}", f"lora.alpha={ALPHA}"])
    yield build_trainer(cfg, pipeline)[0]
    destroy_distributed()


def _sample(engine, cfg: bool = False, **kw):
    extra = CFG if cfg else {}
    return engine.generate([
        RolloutRequest(prompt=p, num_outputs=2, seed=3 * i, num_steps=3, height=SIZE, width=SIZE,
                       return_model_outputs=True, **extra, **kw) for i, p in enumerate(PROMPTS)])


def _recomputed(t) -> torch.Tensor:
    config, window = transition_config(t), sde_step_indices(t)
    return torch.stack([transition_log_prob(t.latents[i:i + 1], t.model_outputs[i:i + 1], t.latents[i + 1:i + 2],
                                            t.sigmas[i], t.sigmas[i + 1], sigma_max=sigma_max_of(t.sigmas),
                                            config=config_for_step(config, i, window)).log_prob[0]
                        for i in range(t.num_steps)])


def _trainer_gap(trainer, trajs) -> float:
    """max over every trained (sample, step) of |trainer log-prob - engine log-prob| / max(1, |engine log-prob|)."""
    from megaflow.trainer.batch import batch_conditioning
    from megaflow.trainer.flowgrpo import _policy
    from megaflow.trainer.flowgrpo_batches import microbatches_for

    transition = transition_config(trajs[0])
    window = [s for s in range(trajs[0].num_steps) if bool(trajs[0].sde_mask[s])]
    items = [(i, s) for i in range(len(trajs)) for s in window]
    mbs = microbatches_for(trajs, torch.zeros(len(trajs)), items, 3, torch.device("cpu"),
                           conditioning=batch_conditioning(trainer))
    gaps = [((_policy(v, mb, transition).log_prob - mb["rollout_log_prob"]).abs()
             / mb["rollout_log_prob"].abs().clamp(min=1.0))[mb["real"]]
            for mb, v in zip(mbs, trainer.forward_backward(mbs, None, forward_only=True))]
    return float(torch.cat(gaps).max())


def _diffusers_velocity(model, t, step: int) -> torch.Tensor:
    """diffusers' velocity at the trajectory's step ``step`` (timestep = sigma), true CFG as QwenImagePipeline."""
    rows = cols = SIZE // 16  # VAE factor 8, then 2x2 packing

    def branch(prefix: str) -> torch.Tensor:
        mask = t.conditioning.get(f"{prefix}encoder_hidden_states_mask")
        return model(hidden_states=t.latents[step][None], timestep=t.sigmas[step][None],
                     encoder_hidden_states=t.conditioning[f"{prefix}encoder_hidden_states"][None],
                     encoder_hidden_states_mask=None if mask is None else mask[None],
                     img_shapes=[[(1, rows, cols)]]).sample[0]

    cond = branch("")
    if not t.do_cfg:
        return cond
    neg = branch("negative_")
    guided = neg + t.guidance_scale * (cond - neg)
    return guided * (cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))


def test_rollouts_recompute_and_match_diffusers_and_the_trainer(engine, trainer, pipeline):
    from diffusers import QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel.from_pretrained(pipeline / "transformer", torch_dtype=torch.float32).eval()
    batches = {name: _sample(engine, **kw) for name, kw in KINDS.items()}
    batches["cfg"] = _sample(engine, cfg=True, sde_type="sde")
    for name, trajs in batches.items():
        t = trajs[0]
        assert len(trajs) == 4 and t.latents.shape == (4, 4, 16) and t.image.shape == (3, SIZE, SIZE), name
        assert {"encoder_hidden_states"} <= set(t.conditioning) and t.height == SIZE, name
        assert trajs[0].conditioning["encoder_hidden_states"].shape[-1] == 32, name
        for x in trajs:
            torch.testing.assert_close(_recomputed(x), x.log_probs, atol=1e-6, rtol=0)
        with torch.no_grad():
            for x in (trajs[0], trajs[-1]):
                for step in range(x.num_steps):
                    torch.testing.assert_close(_diffusers_velocity(model, x, step), x.model_outputs[step],
                                               atol=1e-5, rtol=1e-5)
    assert "negative_encoder_hidden_states" in batches["cfg"][0].conditioning
    assert "negative_encoder_hidden_states" not in batches["sde"][0].conditioning
    assert not torch.equal(batches["cfg"][0].latents[-1], batches["sde"][0].latents[-1])
    gaps = {name: _trainer_gap(trainer, batches[name]) for name in ("sde", "cps", "cfg")}
    control = _trainer_gap(_NoRenorm(trainer), batches["cfg"])
    print(f"max relative |trainer - engine| log-prob: {gaps}; CFG without the rescale: {control}")
    assert all(g <= 1e-5 for g in gaps.values()), gaps
    assert control > 1e-4, control


class _NoRenorm:
    """A trainer whose microbatch conditioning drops ``cfg_renorm`` (plain CFG: the control)."""

    def __init__(self, trainer):
        self._trainer = trainer
        self.config = trainer.config
        self.family = dataclasses.replace(trainer.family, batch_conditioning=self._conditioning)

    def _conditioning(self, config, trajectories, cfg):
        out = self._trainer.family.batch_conditioning(config, trajectories, cfg)
        out.pop("cfg_renorm", None)
        return out

    def forward_backward(self, *args, **kwargs):
        return self._trainer.forward_backward(*args, **kwargs)


def test_bridge_full_weights_and_lora_adapters(engine, trainer, pipeline):
    from megaflow.bridge.lora import LoRABridge, sync_stream
    from megaflow.trainer.checkpoint import read_diffusers_weights
    from megaflow.bridge.shared_memory import SharedMemoryBridge
    from megaflow.bridge.convert import engine_named_params

    sde = KINDS["sde"]
    g = torch.Generator().manual_seed(0)
    base = read_diffusers_weights(pipeline / "transformer")
    trainer.load_diffusers_state_dict({n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in base.items()})
    assert _trainer_gap(trainer, _sample(engine, **sde)) > 1e-3  # the engine still has the pipeline's weights
    report = SharedMemoryBridge([engine]).push(engine_named_params(trainer))
    fused = 3 * 2 * 2  # SGLang holds each block's add_{q,k,v}_proj weight and bias as one to_added_qkv
    assert report.verified and report.num_tensors == len(base) - fused + fused // 3
    assert _trainer_gap(trainer, _sample(engine, **sde)) <= 1e-5
    assert _trainer_gap(trainer, _sample(engine, cfg=True, sde_type="sde")) <= 1e-5

    shapes = {n: t.shape for n, t in trainer.iter_full_adapters()}
    trainer.load_adapters({n: 0.1 * torch.randn(s, generator=g) for n, s in shapes.items()})
    assert _trainer_gap(trainer, _sample(engine, **sde)) > 1e-3  # adapters not pushed yet
    report = LoRABridge([engine], alpha=ALPHA, rank=RANK).push(sync_stream(trainer))
    assert report.verified and report.num_tensors == len(shapes) - 2 * 2 * 2  # add_{q,k,v}: one stacked pair
    assert _trainer_gap(trainer, _sample(engine, **sde)) <= 1e-5
