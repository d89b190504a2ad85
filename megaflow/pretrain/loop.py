"""``megaflow pretrain``: build, train and save the ShapeEval pipeline.

Design notes: docs/design/pretrain.md.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megaflow.config import MegaflowConfig, save_config


def _log(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[pretrain] {msg}", flush=True)


def load_parts(kit, path: Path, *, trust_remote_code: bool = False):
    """(text components, VAE, transformer config, transformer state dict, history) of a saved pipeline; one naming
    code is refused unless ``trust_remote_code``."""
    from megaflow.config.remote_code import refuse_remote_code
    from megaflow.models.pipeline_meta import read_meta
    if not (Path(path) / "model_index.json").is_file():
        raise ValueError(f"pretrain.init_from: {path} is not a diffusers pipeline directory")
    refuse_remote_code(path, "pretrain.init_from", trust=trust_remote_code)
    return (*kit.load_parts(Path(path)), read_meta(path).get("pretrain", {}))


def build_parts(cfg: MegaflowConfig, kit):
    """Phases 1-2 (seeded, identical on every rank): trained text encoders and VAE."""
    from megaflow.pretrain.bench import bench_of
    from megaflow.pretrain.text import train_text_encoder
    from megaflow.pretrain.vae import train_vae

    p, seed, bench = cfg.pretrain, cfg.run.seed, bench_of(kit)
    train, held = bench.text_prompts()
    text = kit.text_components(seed=seed)
    stats = {}
    for k, (tok, enc) in enumerate(kit.trained_encoders(text)):
        t0 = time.perf_counter()
        st = train_text_encoder(kit, enc, tok, train, steps=p.text_steps, seed=seed + k, eval_prompts=held,
                                parse=bench.parse)
        stats[f"text{k + 1}"] = {**st, "seconds": time.perf_counter() - t0}
        _log(f"text encoder {k + 1}: {st} in {time.perf_counter() - t0:.0f}s")
    kit.finish_text(text)
    t0 = time.perf_counter()
    vae = kit.make_vae(seed=seed + 1)
    stats["vae"] = {**train_vae(kit, vae, train, resolution=p.resolution, steps=p.vae_steps, seed=seed, log=_log,
                                bench=bench), "seconds": time.perf_counter() - t0}
    _log(f"vae: {stats['vae']}")
    return text, vae, stats


def build_pool(cfg: MegaflowConfig, kit, pipe, vae) -> dict:
    """The training pool: ``num_images`` renders (clips for a video kit) of TRAIN prompts (balanced over
    categories) as normalised latents, and every pool prompt's conditioning (the family's model inputs) plus the
    empty prompt's (for prompt dropout)."""
    from megaflow.pretrain.bench import bench_of

    p, bench = cfg.pretrain, bench_of(kit)
    prompts = bench.sample_train(p.num_images, seed=cfg.run.seed)
    uniq = sorted(set(prompts))
    index = {q: i for i, q in enumerate(uniq)}
    latents = []
    for i in range(0, len(prompts), 512):
        pixels = bench.render(prompts[i:i + 512], resolution=p.resolution, seed=cfg.run.seed * 7919 + i)
        latents.append(kit.encode(vae, pixels))
    return {"latents": torch.cat(latents), "prompt_index": torch.tensor([index[q] for q in prompts]),
            "conditioning": kit.conditioning(pipe, uniq + [""]), "shared": kit.constant_inputs(p.resolution),
            "empty": len(uniq)}


def _batch(pool: dict, gen: torch.Generator, batch: int, dropout: float) -> dict:
    """One batch of the pool: the rectified-flow pair at logit-normal sigmas and each sample's conditioning."""
    from megaflow.trainer.runner import rectified_flow_microbatch
    idx = torch.randint(len(pool["latents"]), (batch,), generator=gen)
    cond = pool["prompt_index"][idx]
    cond = torch.where(torch.rand(batch, generator=gen) < dropout, pool["empty"], cond)
    x0 = pool["latents"][idx]
    noise = torch.randn(x0.shape, generator=gen)
    sigma = torch.sigmoid(torch.randn(batch, generator=gen))  # logit-normal(0, 1), as SD3
    return rectified_flow_microbatch(x0, noise, sigma, **{k: v[cond] for k, v in pool["conditioning"].items()})


class EMA:
    """Exponential moving average of this rank's parameter shards (fp32)."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float):
        self.params, self.decay = params, decay
        self.shadow = [p.detach().float().clone() for p in params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        d = min(self.decay, (1 + step) / (10 + step))
        torch._foreach_lerp_(self.shadow, [p.detach().float() for p in self.params], 1 - d)

    @torch.no_grad()
    def swap(self) -> None:
        """Exchange live weights and EMA weights (call twice to restore)."""
        for p, s in zip(self.params, self.shadow):
            tmp = p.detach().clone()
            p.copy_(s)
            s.copy_(tmp)


@torch.no_grad()
def sample_latents(trainer, conditioning: dict, shared: dict, *, shape, sigmas: torch.Tensor,
                   seed: int) -> torch.Tensor:
    """Deterministic Euler (ODE) sampling over ``sigmas`` with the trainer's own forward (on its device; the noise
    is drawn on the CPU); under pipeline parallelism the last stage's velocity is broadcast to every stage, so
    every rank returns the same latents (on the CPU)."""
    from megatron.core import parallel_state as ps

    from megaflow.parallel.distributed import current_device
    device = current_device()
    sigmas = sigmas.to(device)
    conditioning = {k: v.to(device) for k, v in conditioning.items()}
    shared = {k: v.to(device) for k, v in shared.items()}
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)
    pp = ps.get_pipeline_model_parallel_world_size()
    for i in range(len(sigmas) - 1):
        v = trainer.velocity(x, sigmas[i].expand(shape[0]), shared=shared, **conditioning)
        if pp > 1:
            v = v if v is not None else torch.empty_like(x)
            src = dist.get_global_rank(ps.get_pipeline_model_parallel_group(), pp - 1)
            dist.broadcast(v, src=src, group=ps.get_pipeline_model_parallel_group())
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    return x.cpu()


def evaluate(cfg: MegaflowConfig, kit, trainer, pipe, vae, *, seed: int = 0) -> dict:
    """Held-out (and seen) ShapeEval accuracy of the model's ODE samples: images, or clips for a video kit (the
    prompt sets and scoring of ``megaflow.pretrain.bench``; the sampler is the trainer's own forward)."""
    from megaflow.pretrain.bench import bench_of

    p, bench = cfg.pretrain, bench_of(kit)
    held, seen = bench.eval_prompts(p.eval_prompts, seed)
    shape = kit.latent_shape(len(held) + len(seen), p.resolution)
    sigmas = kit.sample_sigmas(pipe, p.sample_steps, p.resolution)
    lat = sample_latents(trainer, kit.conditioning(pipe, held + seen), kit.constant_inputs(p.resolution),
                         shape=shape, sigmas=sigmas, seed=seed)
    samples = kit.decode(vae, lat)
    return {**bench.score(samples[:len(held)], held), "seen": bench.score(samples[len(held):], seen)}


def run(cfg: MegaflowConfig) -> dict:
    """Pretrain the pipeline of ``cfg`` (``pretrain.*``): the last evaluation row ({} on ranks other than 0)."""
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import current_device, init_distributed
    from megaflow.pretrain.kit import family_kit
    from megaflow.trainer.settings import scheduled_lr, set_lr

    torch.set_num_threads(cfg.run.num_threads)
    par, p = cfg.parallel, cfg.pretrain
    init_distributed(ParallelDims(tp=par.tp, pp=par.pp, cp=par.cp, sp=par.sp, vpp=par.vpp or None), seed=cfg.run.seed)
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    if dist.get_rank() == 0:
        save_config(cfg, run_dir)
    t_start = time.perf_counter()
    kit = family_kit(cfg.model.family)
    parts = _pipeline_parts(cfg, kit)
    pipe = kit.assemble(text=parts.text, vae=parts.vae, transformer_config=parts.transformer_config,
                    transformer_state=parts.transformer_state, seed=cfg.run.seed)
    device = current_device()  # the DiT trains here; the VAE encodes the pool and decodes samples here too
    vae_on_device = copy.deepcopy(parts.vae).to(device) if device.type != "cpu" else parts.vae
    pool = build_pool(cfg, kit, pipe, vae_on_device)
    _log(f"pool: {len(pool['latents'])} renders of {pool['empty']} prompts ({time.perf_counter() - t_start:.0f}s so far)")
    trainer = _dit_trainer(cfg, pipe, run_dir)
    ema = EMA([q for m in trainer.chunks for q in m.parameters()], p.ema_decay)
    dp, dp_rank = _dp()
    if p.batch_size % dp:
        raise ValueError(f"pretrain.batch_size = {p.batch_size} must be divisible by the data-parallel size {dp}")
    gen = torch.Generator().manual_seed(cfg.run.seed)
    recorder = _Recorder(cfg, kit, run_dir, parts, trainer, ema, pipe, vae_on_device)
    step = 0
    while step < p.max_steps and (time.perf_counter() - recorder.t_dit) < p.minutes * 60:
        mb = _batch(pool, gen, p.batch_size, p.prompt_dropout)
        mb = {**{k: v.chunk(dp)[dp_rank].to(device) for k, v in mb.items() if v is not None},
              **{k: v.to(device) for k, v in pool["shared"].items()}}
        set_lr(trainer.optimizer, scheduled_lr(p.lr, step, warmup=p.warmup_steps, total=p.max_steps,
                                              schedule=p.lr_schedule))
        out = trainer.train_step([mb])
        if not math.isfinite(float(out["loss"])):
            raise RuntimeError(f"pretrain: loss is {float(out['loss'])} at step {step}")
        recorder.losses.append(float(out["loss"]))
        step += 1
        ema.update(step)
        if step % p.eval_every == 0:
            recorder.checkpoint(step)
    if step % p.eval_every:
        recorder.checkpoint(step)
    return recorder.history[-1] if recorder.history else {}


@dataclasses.dataclass
class _Parts:
    """What the DiT trains with: text components, VAE, transformer config and initial state (None: fresh), and
    the record of how they were made (``stats``, saved in the pipeline's metadata)."""
    text: object
    vae: object
    transformer_config: dict
    transformer_state: dict | None
    stats: dict


def _pipeline_parts(cfg: MegaflowConfig, kit) -> _Parts:
    """``pretrain.init_from``'s parts (its resolution must match where the DiT fixes one), else text encoders and
    VAE trained now and a fresh transformer config."""
    p = cfg.pretrain
    if p.init_from:
        text, vae, tcfg, init_state, previous = load_parts(kit, Path(p.init_from),
                                                           trust_remote_code=cfg.model.trust_remote_code)
        saved = kit.resolution_of(tcfg)
        if saved is not None and saved != p.resolution:
            raise ValueError(f"pretrain.resolution = {p.resolution} does not match {p.init_from} ({saved} px)")
        return _Parts(text, vae, tcfg, init_state, {"init_from": p.init_from, "previous": previous})
    text, vae, stats = build_parts(cfg, kit)
    tcfg = kit.transformer_config(resolution=p.resolution, num_layers=p.num_layers, num_heads=p.num_heads,
                                  head_dim=p.head_dim)
    return _Parts(text, vae, tcfg, None, stats)


def _dit_trainer(cfg: MegaflowConfig, pipe, run_dir: Path):
    """A megatron ``Trainer`` holding ``pipe``'s transformer (its config goes through a diffusers save on rank 0)."""
    from megaflow.models.registry import get_family
    from megaflow.trainer.runner import Trainer, adam_config
    from megaflow.trainer.settings import transformer_kwargs

    p = cfg.pretrain
    tdir = run_dir / ".init-transformer"
    if dist.get_rank() == 0:
        pipe.transformer.save_pretrained(tdir, safe_serialization=True)
    if dist.get_world_size() > 1:
        dist.barrier()
    family = cfg.model.family
    mcfg = get_family(family).config_from_diffusers(tdir / "config.json", **transformer_kwargs(cfg))
    trainer = Trainer(mcfg, family=family, spec=cfg.model.spec,
                     optimizer_config=adam_config(lr=p.lr, weight_decay=p.weight_decay, grad_clip=1.0))
    trainer.load_diffusers_state_dict(pipe.transformer.state_dict())
    return trainer


class _Recorder:
    """Every evaluation of the DiT's EMA: a row in <run dir>/pretrain.jsonl and the pipeline saved with the EMA
    weights (rank 0; every rank takes part in gathering and evaluating)."""

    def __init__(self, cfg: MegaflowConfig, kit, run_dir: Path, parts: _Parts, trainer, ema, pipe, vae_on_device):
        from megaflow.models.registry import get_family
        self.cfg, self.kit, self.run_dir, self.parts, self.trainer, self.ema = cfg, kit, run_dir, parts, trainer, ema
        self.pipe, self.vae_on_device, self.family = pipe, vae_on_device, get_family(cfg.model.family)
        self.history: list[dict] = []
        self.losses: list[float] = []
        self.t_dit = time.perf_counter()

    def checkpoint(self, step: int) -> None:
        self.ema.swap()
        trainer = self.trainer
        state = {n: t.to("cpu", copy=True)  # a copy: replicated tensors are views of the live weights
                 for name, tensor in trainer.iter_full_params()
                 for n, t in self.family.weight_map.megatron_to_diffusers(name, tensor, trainer.config)}
        result = evaluate(self.cfg, self.kit, trainer, self.pipe, self.vae_on_device)
        self.ema.swap()
        if dist.get_rank() != 0:
            return
        row = {"step": step, "minutes": (time.perf_counter() - self.t_dit) / 60,
               "loss": float(np.mean(self.losses[-100:])), "accuracy": result["accuracy"],
               "partial": result["partial_mean"], "per_category": result["per_category"],
               "seen": result["seen"]["per_category"],
               **{k: result[k] for k in ("frames_mean", "clause_mean") if k in result}}
        self.history.append(row)
        with open(self.run_dir / "pretrain.jsonl", "a") as fh:
            fh.write(json.dumps(row, sort_keys=True) + "\n")
        _log(f"step {step} ({row['minutes']:.1f} min): loss {row['loss']:.4f} held-out acc {row['accuracy']:.3f} "
             f"partial {row['partial']:.3f} per-category {json.dumps({k: round(v, 2) for k, v in row['per_category'].items()})}"
             f" seen {json.dumps({k: round(v, 2) for k, v in row['seen'].items()})}")
        self._save(state, step)

    def _save(self, state: dict, step: int) -> None:
        from megaflow.models.pipeline_meta import META_FILE
        from megaflow.pretrain.kit import meta_text, save_pipeline
        cfg, parts, kit = self.cfg, self.parts, self.kit
        record = {"config": dataclasses.asdict(cfg.pretrain), "seed": cfg.run.seed, "step": step,
                  "history": self.history, "parts": parts.stats}
        pipe = kit.assemble(text=parts.text, vae=parts.vae, transformer_config=parts.transformer_config,
                            transformer_state=state, seed=cfg.run.seed)
        save_pipeline(kit, pipe, self.run_dir / "pipeline", extra_files={META_FILE: meta_text(kit, record)})


def _dp() -> tuple[int, int]:
    from megatron.core import parallel_state as ps
    return ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
