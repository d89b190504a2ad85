"""``megaflow plan``: GPU memory per rank of a run, before anything starts (standard library only).

Design notes: docs/design/plan.md.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from megaflow.config.load import ConfigError
from megaflow.config.schema import MegaflowConfig
from megaflow.parallel.dims import ParallelDims
from megaflow.parallel.placement import launch_layout
from megaflow.families import card
from megaflow.plan.dit import (
    BLOCK_INPUTS, INFERENCE_LIVE, LORA_STAGE_EXTRA, STAGE_EXTRA, VAE_DECODE_PER_PIXEL, DiTDims, block_activation_units,
    block_params, buffer_bytes, dims_from_config, embed_params, final_params, lora_params, total_params,
)
from megaflow.plan.rewards import MODELS_ITEM, SCORING_ITEM, describe, reward_items, reward_loads, scoring_ranks
from megaflow.plan.weights import folder_numel

GIB = 2**30
OPTIMIZER_STEP_BYTES = 4  # per trained parameter (and data-parallel rank): Adam's fp32 step temporaries
RUNTIME_OVERHEAD = 2.0 * GIB  # CUDA context, NCCL buffers, allocator slack per GPU process
_BYTES = {"float32": 4, "bfloat16": 2, "fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class RankPlan:
    """Memory of one group of identical ranks, in bytes per item."""

    ranks: list[int]
    items: dict[str, float] = field(default_factory=dict)
    info: dict[str, float] = field(default_factory=dict)
    """Figures shown for comparison, not counted (activations without recompute)."""
    phases: dict[str, float] = field(default_factory=dict)
    """A trainer rank hosting engines in a phased run (``MegaflowConfig.phased``): the bytes of each phase
    ("train", "rollout"); empty: every item is held at once."""

    @property
    def total(self) -> float:
        """The rank's peak: the larger phase, or every item together."""
        return max(self.phases.values()) if self.phases else sum(self.items.values())


ROLLOUT_RESIDENT = {
    "none": ("weights", "LoRA adapters", "grads (fp32 buffer)", "optimizer (Adam, /dp)", "KL reference", "runtime"),
    "optimizer": ("weights", "LoRA adapters", "KL reference", "runtime"),
    "all": ("KL reference", "runtime"),
}
"""Trainer items that stay on the GPU while engines sample, per ``train.offload``."""


def phase_bytes(items: dict[str, float], offload: str, buffers: float) -> dict[str, float]:
    """{"train", "rollout"} bytes of a phased trainer rank with engines: in training the engines have released
    their memory (SGLang moves their modules to host memory) and the batch is scored, so the trainer's items and
    the reward models count; while they sample, their items, the rewards' and what the trainer keeps
    (``ROLLOUT_RESIDENT``; with "all", the model's non-parameter buffers ``buffers`` too, which stay)."""
    rollout_only = sum(v for k, v in items.items() if k.startswith("engine") or k == SCORING_ITEM)
    kept = sum(items.get(k, 0.0) for k in (*ROLLOUT_RESIDENT[offload], MODELS_ITEM))
    return {"train": sum(items.values()) - rollout_only,
            "rollout": kept + (buffers if offload == "all" else 0.0) + rollout_only}


def engine_placement(cfg: MegaflowConfig, world: int, per_node: int = 8) -> tuple[dict[int, int], int]:
    """(rank -> number of rollout engines it hosts, number of trainer ranks) of a launch of ``world`` ranks
    with ``per_node`` (at most) per node (megaflow.parallel.placement: ``rollout.placement``, ``engine_hosts``,
    ``engine_ranks``)."""
    r = cfg.rollout
    hosts, trainers = launch_layout(r.placement, r.engine_hosts, r.engine_ranks, world, min(world, per_node))
    return {rank: r.num_engines for rank in hosts}, trainers


def vae_factors(conf: dict, temporal: int) -> tuple[int, int]:
    """(spatial, temporal) compression of a diffusers VAE config: its ``scale_factor_spatial`` /
    ``scale_factor_temporal`` (AutoencoderKLWan), else 2 per down block (``block_out_channels``, a Wan VAE's
    ``dim_mult``) and the card's ``temporal``."""
    blocks = conf.get("block_out_channels") or conf.get("dim_mult") or [0] * 4
    return (int(conf.get("scale_factor_spatial") or 2 ** (len(blocks) - 1)),
            int(conf.get("scale_factor_temporal") or temporal))


def pipeline_dims(cfg: MegaflowConfig) -> tuple[DiTDims, dict[str, int], tuple[int, int]]:
    """(DiT dims, {"text encoders": params, "vae": params}, the VAE's (spatial, temporal) compression): from
    model.pretrained's configs and safetensors headers when that directory is here, else the built-in tables (the
    published model named by the directory, ``FamilyCard.builtin_for``)."""
    family, root = cfg.model.family, Path(cfg.model.pretrained) if cfg.model.pretrained else None
    c = card(family)
    if root is not None and (root / "transformer" / "config.json").is_file():
        conf = json.loads((root / "transformer" / "config.json").read_text())
        dims = dims_from_config(family, conf, f"{root}/transformer/config.json")
        enc = {"text encoders": sum(folder_numel(p) for p in root.glob("text_encoder*")),
               "vae": folder_numel(root / "vae")}
        vae_conf = root / "vae" / "config.json"
        vae = json.loads(vae_conf.read_text()) if vae_conf.is_file() else {}
        return dims, enc, vae_factors(vae, c.temporal_compression)
    if root is None:
        raise ValueError("megaflow plan needs model.pretrained (a pipeline dir, or the path it will be "
                         "downloaded to: the built-in table of the family is used when it is missing)")
    source, conf = c.builtin_for(root.name)
    return (dims_from_config(family, conf, source), {"text encoders": c.encoder_params, "vae": c.vae_params},
            (8, c.temporal_compression))


def _stage_blocks(d: DiTDims, pp: int, stage: int) -> range:
    per = d.num_blocks // pp
    return range(stage * per, (stage + 1) * per)


def trained_steps(cfg: MegaflowConfig) -> int:
    """Denoising steps trained per sample: the SDE window's size, else the first int(num_steps x
    timestep_fraction) steps (config.preflight's rule; CPS never trains its last step)."""
    r = cfg.rollout
    if r.sde_window_size:
        return r.sde_window_size
    steps = sorted(set(r.sde_window)) if r.sde_window else list(range(int(r.num_steps * cfg.algo.timestep_fraction)))
    return len([t for t in steps if not (r.sde_type == "cps" and t == r.num_steps - 1)])


def microbatch_bytes(cfg: MegaflowConfig, d: DiTDims, *, dp: int, image: int, text: int) -> float:
    """One optimizer step's microbatches, all on the GPU at once (megaflow.trainer.flowgrpo_batches.microbatches_for):
    this DP rank's share of the step's (sample, step) items, padded to whole micro-batches, each holding x_t
    (twice under CFG) and x_{t+1} in fp32 and the text conditioning in rollout.precision (negative and positive
    under CFG). Every sample counted as kept (filtered groups only lower it)."""
    r, t = cfg.rollout, cfg.train
    items = -(-r.prompts_per_iter * r.group_size // t.num_minibatches) * trained_steps(cfg)
    per_rank = -(-(-(-items // dp)) // t.micro_batch_size) * t.micro_batch_size
    cfg_copies = card(d.family).cfg_copies(r.guidance_scale)
    latent = image * d.in_channels * d.patch * d.patch * 4 * (cfg_copies + 1)
    cond = (text * d.joint_dim + d.pooled_dim) * _BYTES[r.precision] * cfg_copies
    return per_rank * (latent + cond)


def trainer_items(cfg: MegaflowConfig, d: DiTDims, *, world: int, stage: int, image: int,
                  text: int) -> tuple[dict, dict]:
    """(counted items, info) of the trainer on one rank of pipeline stage ``stage`` (the module's design notes)."""
    p, t, tp, pp = cfg.parallel, cfg.train, cfg.parallel.tp, cfg.parallel.pp
    dp = max(1, world // (tp * pp * p.cp))
    blocks = _stage_blocks(d, pp, stage)
    local = sum(s / tp + r for s, r in (block_params(d, i) for i in blocks))
    local += (embed_params(d) if stage == 0 else 0) + (final_params(d) if stage == pp - 1 else 0)
    wb = _BYTES[cfg.model.dtype]
    batch = t.micro_batch_size * card(d.family).cfg_copies(cfg.rollout.guidance_scale)
    in_flight = pp - stage if pp > 1 else 1
    lora = cfg.lora
    # Frozen base: torch's F.linear (megaflow's local linears at TP=1) and Transformer Engine's linears (spec
    # auto/te on GPU) keep no input of a frozen weight; megatron's own linear function (spec local at TP>1)
    # keeps its input whatever the weight, so there the full-parameter coefficients stay.
    frozen = bool(lora.rank) and (tp == 1 or cfg.model.spec in ("auto", "te"))
    targets = tuple(lora.targets) if frozen else None
    extra = LORA_STAGE_EXTRA if frozen else STAGE_EXTRA
    full = [block_activation_units(d, i, image, text, tp, p.sp, targets) for i in blocks]
    stream = (image + text) / (tp if p.sp else 1)
    recomputed = len(full) if t.recompute == "full" and not t.recompute_num_layers else \
        (min(t.recompute_num_layers, len(full)) if t.recompute == "full" else 0)
    kept = sum(full[recomputed:]) + recomputed * BLOCK_INPUTS * stream + (max(full[:recomputed]) if recomputed else 0)
    act_unit = batch * d.hidden * wb
    trained = sum(lora_params(d, i, lora.rank, lora.targets) for i in blocks) / tp if lora.rank else local
    items = {
        "weights": local * wb + (buffer_bytes(d) if stage == 0 else 0),
        **({"LoRA adapters": trained * wb} if lora.rank else {}),
        "grads (fp32 buffer)": trained * 4,
        "optimizer (Adam, /dp)": trained * (8 + (4 if wb == 2 else 0)) / dp,
        "activations": (kept + extra * stream) * act_unit * in_flight,
        "GRPO microbatches (1 step)": microbatch_bytes(cfg, d, dp=dp, image=image, text=text),
    }
    info = {"activations without recompute": (sum(full) + extra * stream) * act_unit * in_flight} \
        if recomputed else {}
    # The optimizer step's temporaries (torch's multi-tensor Adam over the fp32 main params: measured on an H200,
    # 4.0 bytes per trained parameter for an SD3.5-M step) come after backward has freed the activations: the
    # step's peak is the larger of the two, so what they add beyond the activations is counted.
    items["optimizer step temporaries"] = max(0.0, OPTIMIZER_STEP_BYTES * trained / dp - items["activations"])
    if cfg.algo.kl_beta > 0 and not lora.rank:  # under LoRA the reference is the base, adapters off
        items["KL reference"] = local * wb + (buffer_bytes(d) if stage == 0 else 0)
    items["runtime"] = RUNTIME_OVERHEAD
    return items, info


def engine_items(cfg: MegaflowConfig, d: DiTDims, enc: dict[str, int], *, image: int, text: int,
                 temporal: int | None = None) -> dict:
    """One rollout engine: DiT, text encoders, VAE in rollout.precision; sampling and decode activations. A video
    VAE decodes one latent frame at a time (its causal cache), ``temporal`` frames live, into the whole clip
    (fp32, 3 channels)."""
    r, eb = cfg.rollout, _BYTES[cfg.rollout.precision]
    batch = r.max_batch_outputs * card(d.family).cfg_copies(r.guidance_scale)
    pixels = r.max_batch_outputs * r.height * r.width
    if card(d.family).frames:
        live = min(r.num_frames, temporal or card(d.family).temporal_compression)
        decode = pixels * (live * VAE_DECODE_PER_PIXEL * eb + r.num_frames * 3 * 4)
    else:
        decode = pixels * VAE_DECODE_PER_PIXEL * eb
    return {
        "engine DiT": total_params(d) * eb + buffer_bytes(d),
        "engine text encoders": enc["text encoders"] * eb,
        "engine VAE": enc["vae"] * eb,
        # INFERENCE_LIVE counts a 4h MLP's two tensors: a block with another MLP width (Wan) counts its own
        "engine sampling activations": batch * (image + text) * d.hidden * eb * (INFERENCE_LIVE
                                                                               + 2 * (d.mlp / d.hidden - 4)),
        "engine VAE decode": decode,
    }


MAX_GPUS = 100_000  # --gpus beyond this is a typo (the plan walks every rank)


def check_plan_args(gpus: int, gpu_mem_gib: float) -> int:
    """``--gpus`` (0: not given) and ``--gpu-mem-gb`` of ``megaflow plan``; ConfigError naming the flag when
    either is out of range. Returns ``gpus``."""
    if not 0 <= gpus <= MAX_GPUS:
        raise ConfigError(f"--gpus {gpus}: must be a GPU count from 1 to {MAX_GPUS} (omitted: parallel.gpus, else "
                          "WORLD_SIZE if set, else parallel.tp * pp * cp plus rollout.engine_ranks)")
    if not (math.isfinite(gpu_mem_gib) and gpu_mem_gib > 0):
        raise ConfigError(f"--gpu-mem-gb {gpu_mem_gib}: must be a positive, finite memory per GPU in GiB")
    return gpus


def latent_frames(cfg: MegaflowConfig, d: DiTDims, temporal: int | None = None) -> int:
    """Latent frames of one sample: a video family's VAE keeps the first frame and compresses the rest by
    ``temporal`` (the card's when None): (rollout.num_frames - 1) // temporal + 1; an image is one."""
    family = card(d.family)
    if not family.frames:
        return 1
    return (cfg.rollout.num_frames - 1) // (temporal or family.temporal_compression) + 1


def token_counts(cfg: MegaflowConfig, d: DiTDims, vae_factor: int = 8, temporal: int | None = None) -> tuple[int, int]:
    """(image, text) tokens of one sample at the rollout's size: latent / the family's token side (FLUX packs 2x2
    latents into one token), times the latent frames of a video family (``latent_frames``); text = T5's
    max_sequence_length plus the family's fixed tokens (CLIP's 77 for SD3), or the family's default."""
    family, max_len = card(d.family), cfg.rollout.max_sequence_length
    pack = family.token_side(d.patch)
    image = (cfg.rollout.height // vae_factor // pack) * (cfg.rollout.width // vae_factor // pack)
    text = max_len + family.fixed_text_tokens if max_len else family.default_text_tokens
    return image * latent_frames(cfg, d, temporal), text


def plan(cfg: MegaflowConfig, *, gpus: int, gpu_mem_gib: float) -> dict:
    """The plan as a dict: dims, token counts, one RankPlan per group of ranks, fits."""
    d, enc, (vae_factor, temporal) = pipeline_dims(cfg)
    p = cfg.parallel
    placement, trainers = engine_placement(cfg, gpus)
    dims = ParallelDims.of(p)
    dims.dp_for(trainers, ranks=f"the {trainers} trainer GPU(s) of --gpus {gpus}")
    dims.check_model(None, d.num_blocks, d.source)
    image, text = token_counts(cfg, d, vae_factor, temporal)
    frames = latent_frames(cfg, d, temporal)
    loads = reward_loads(cfg)
    scorers = scoring_ranks(cfg, placement)
    groups: dict[tuple, RankPlan] = {}
    for rank in range(gpus):
        trains = rank < trainers  # disaggregated: the last ranks only sample
        stage = (rank // (trainers // p.pp)) if p.pp > 1 and trains else 0
        key = (trains, stage, placement.get(rank, 0), rank in scorers)
        if key not in groups:
            # an engine rank's own process still holds a CUDA context, NCCL buffers and received buckets
            items, info = trainer_items(cfg, d, world=trainers, stage=stage, image=image, text=text) if trains \
                else ({"runtime": RUNTIME_OVERHEAD}, {})
            if key[2]:
                items.update({n: v * key[2] for n, v in engine_items(cfg, d, enc, image=image, text=text,
                                                                     temporal=temporal).items()})
            if key[3]:
                items.update(reward_items(cfg, loads))
            phases = phase_bytes(items, cfg.train.offload, buffer_bytes(d) if stage == 0 else 0.0) \
                if key[2] and trains and cfg.phased else {}
            groups[key] = RankPlan(ranks=[], items=items, info=info, phases=phases)
        groups[key].ranks.append(rank)
    limit = gpu_mem_gib * GIB
    return {"dims": d, "params": total_params(d), "image_tokens": image, "text_tokens": text, "gpus": gpus,
            "latent_frames": frames, "frames": cfg.rollout.num_frames if card(d.family).frames else 0,
            "groups": list(groups.values()), "limit": limit, "offload": cfg.train.offload,
            "rewards": describe(loads), "fits": all(g.total <= limit for g in groups.values())}


def format_plan(result: dict) -> str:
    """Human-readable plan (GiB)."""
    d: DiTDims = result["dims"]
    lines = [f"model: {d.family} from {d.source}: {result['params'] / 1e9:.2f}B params (+ "
             f"{buffer_bytes(d) / GIB:.2f} GiB fp32 buffers), hidden {d.hidden}, "
             f"{d.blocks}{f' + {d.single_blocks} single' if d.single_blocks else ''} blocks, "
             f"{result['image_tokens']} image + {result['text_tokens']} text tokens" + (
                 f" ({result['frames']} frames -> {result['latent_frames']} latent frames of "
                 f"{result['image_tokens'] // result['latent_frames']} tokens)" if result["frames"] else ""),
             f"GPUs: {result['gpus']}, limit {result['limit'] / GIB:.1f} GiB per GPU", *result["rewards"]]
    for g in result["groups"]:
        ranks = g.ranks
        span = f"{ranks[0]}" if len(ranks) == 1 else f"{ranks[0]}..{ranks[-1]}" if ranks == list(
            range(ranks[0], ranks[-1] + 1)) else ",".join(map(str, ranks))
        fits = "fits" if g.total <= result["limit"] else "DOES NOT FIT"
        lines.append(f"rank {span}: {g.total / GIB:.1f} GiB, {fits}")
        lines += [f"    {name:<30} {value / GIB:8.2f} GiB" for name, value in g.items.items()]
        lines += [f"    ({name}: {value / GIB:.2f} GiB)" for name, value in g.info.items()]
        if g.phases:
            lines.append(f"    peak per phase (train.offload = {result['offload']!r}; engines released in training): "
                         + ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in g.phases.items())
                         + f" (all items at once: {sum(g.items.values()) / GIB:.1f} GiB)")
    lines.append(f"fits: {'yes' if result['fits'] else 'no'}")
    return "\n".join(lines)
