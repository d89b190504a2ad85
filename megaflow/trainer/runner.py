"""The megatron trainer of a flow-matching DiT: model + DDP + optimizer, a training step through megatron's
``get_forward_backward_func`` (all parallelisms apply), a velocity forward and full-tensor gathers.
Design notes: docs/design/trainer.md.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from megaflow.families import DEFAULT_FAMILY
from megaflow.models.common.lora import LoRASettings, adapter_state, adapters_disabled, attach_lora
from megaflow.models.common.lora_map import lora_weight_map
from megaflow.models.provider import build_model_chunks
from megaflow.models.registry import get_family
from megaflow.parallel.perf_patches import PERF_PATCHES, apply_perf_patches
from megaflow.trainer.fast_paths import FastPaths, SingleRankDDP, select_fast_paths, use_foreach_torch_adam
from megaflow.trainer.full_weights import iter_full, load_checked
from megaflow.trainer.settings import LRSchedule, set_lr

__all__ = ["BaseReference", "FastPaths", "LossFn", "ModelRunner", "ReferenceModel", "SingleRankDDP", "Trainer", "adam_config",
           "iter_full", "load_checked", "rectified_flow_loss", "rectified_flow_microbatch", "unwrap"]

LossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]]


def adam_config(*, lr: float, weight_decay: float = 0.0, grad_clip: float = 1.0, betas=(0.9, 0.999),
                eps: float = 1e-8, distributed: bool = True, bf16: bool = False) -> OptimizerConfig:
    """megatron Adam(W) config (decoupled weight decay); ``distributed`` = ZeRO-1 DistributedOptimizer."""
    return OptimizerConfig(
        optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=grad_clip, adam_beta1=betas[0],
        adam_beta2=betas[1], adam_eps=eps, use_distributed_optimizer=distributed, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
    )


def rectified_flow_microbatch(x0, noise, sigma, encoder_hidden_states=None, pooled_projections=None,
                              **conditioning) -> dict:
    """SFT microbatch: x_t = (1 - sigma) x0 + sigma noise, target velocity v = noise - x0; ``conditioning``: the
    family's other model inputs (e.g. Qwen-Image's text mask and image grid)."""
    s = sigma.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return {
        "latents": (1 - s) * x0 + s * noise, "sigma": sigma, "target": noise - x0,
        "encoder_hidden_states": encoder_hidden_states, "pooled_projections": pooled_projections, **conditioning,
    }


def rectified_flow_loss(velocity: torch.Tensor, microbatch: dict):
    """Mean squared error between predicted and target velocity (rectified-flow SFT loss)."""
    loss = F.mse_loss(velocity.float(), microbatch["target"].float())
    return loss, {"loss": loss.detach().clone()}


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The model chunk inside DDP / Float16Module wrappers."""
    while isinstance(module, (DistributedDataParallel, Float16Module)):
        module = module.module
    return module


class ModelRunner:
    """This rank's model chunks driven through megatron's schedule: diffusers weights in, forward (and backward),
    full tensors out. ``model``: the chunks as the schedule takes them; ``chunks`` unwraps them."""

    def __init__(self, config, family: str, model: list[torch.nn.Module]):
        self.config, self.family, self.model = config, get_family(family), model

    @property
    def chunks(self) -> list[torch.nn.Module]:
        """Unwrapped model chunks (one per virtual pipeline stage)."""
        return [unwrap(m) for m in self.model]

    # ---- weights in -------------------------------------------------------------------------
    def load_diffusers_state_dict(self, diffusers_sd: dict[str, torch.Tensor]) -> None:
        """Load full diffusers weights (each rank its TP shard; LoRA adapters kept); ValueError names the first bad shape."""
        wm = self.family.weight_map
        for chunk, local in self._local_shards(wm, wm.to_megatron_full(diffusers_sd, self.config)):
            load_checked(chunk, {**local, **adapter_state(chunk)})

    def _local_shards(self, weight_map, full: dict[str, torch.Tensor]):
        """(chunk, this rank's local state dict of it) for every chunk, from a full global megatron state dict
        over ``weight_map``."""
        tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        for chunk in self.chunks:
            yield chunk, weight_map.select_local(full, self.config, tp_rank=tp_rank, tp_size=tp_size,
                                                 pp_rank=chunk.pp_rank, vp_stage=chunk.vp_stage)

    # ---- steps --------------------------------------------------------------------------------
    def forward_backward(self, microbatches: list[dict], loss_fn: LossFn | None, *,
                         forward_only: bool = False) -> list:
        """Run megatron's schedule over ``microbatches``; returns, on the last pipeline stage, the
        loss functions' metric dicts (or the raw velocities when ``loss_fn`` is None), else [].
        ``forward_only`` runs without autograd (megatron's schedule records a graph otherwise, and every
        microbatch's activations would live until the velocities are dropped)."""
        first = microbatches[0]
        seq_length = self.family.microbatch_seq_length(self.config, first)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            out = model(**self.family.model_inputs(self.config, mb))
            return out, (partial(_megatron_loss, loss_fn, mb) if loss_fn is not None else None)

        iterators = [iter(microbatches) for _ in self.model]
        with torch.set_grad_enabled(torch.is_grad_enabled() and not forward_only):
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iterators if len(iterators) > 1 else iterators[0],
                model=self.model, num_microbatches=len(microbatches), seq_length=seq_length,
                micro_batch_size=first["latents"].shape[0], forward_only=forward_only,
            )

    def velocity(self, latents, sigma, encoder_hidden_states, pooled_projections=None, *,
                 shared: dict | None = None, **conditioning) -> torch.Tensor | None:
        """Per-timestep forward v(x_t, sigma | conditioning): the velocity (the latents' layout) on the last
        pipeline stage, None on other stages. ``conditioning``: the family's other batched inputs; ``shared``:
        inputs every sample shares (not split). The batch runs as one microbatch, or as PP equal
        microbatches under interleaved (VPP) pipelining, which needs at least PP of them."""
        num = 1
        if self.config.virtual_pipeline_model_parallel_size is not None:
            num = self.config.pipeline_model_parallel_size
            if latents.shape[0] % num:
                raise ValueError(f"batch {latents.shape[0]} must be divisible by pp={num} with virtual pipelining")
        batched = dict(latents=latents, sigma=sigma, encoder_hidden_states=encoder_hidden_states,
                       pooled_projections=pooled_projections, **conditioning)
        parts = {k: (v.chunk(num) if v is not None else [None] * num) for k, v in batched.items()}
        mbs = [{**{k: v[i] for k, v in parts.items()}, **(shared or {})} for i in range(num)]
        out = self.forward_backward(mbs, None, forward_only=True)
        return torch.cat(out) if out else None

    # ---- weights out --------------------------------------------------------------------------
    def iter_full_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (global name, full tensor) per weight. Collective: every model-parallel rank iterates to the end
        together. A yielded tensor may be the live parameter, valid until the next step: ``.clone()`` what you keep."""
        yield from iter_full(self, lambda chunk: {**dict(chunk.named_parameters()), **dict(chunk.named_buffers())})


def _build_chunks(config, family: str, spec: str, lora: LoRASettings | None = None) -> list[torch.nn.Module]:
    """This rank's chunks from the model provider (with ``lora``: base frozen, adapters attached), in
    ``Float16Module`` when the config is bf16/fp16."""
    chunks = build_model_chunks(config, family=family, spec=spec)
    for c in chunks if lora is not None else ():
        attach_lora(c, get_family(family).weight_map, lora)
    if config.bf16 or config.fp16:
        chunks = [Float16Module(config, c) for c in chunks]
    return chunks


class Trainer(ModelRunner):
    """This rank's model chunks (DDP-wrapped), optimizer and step functions. ``optimizer_config=None``: no
    optimizer; ``fast_paths`` picks megaflow.trainer.fast_paths' shortcuts (``fast_paths_active`` names those in
    effect); ``lora``: train adapters on a frozen base; ``lr_schedule``: the lr of each iteration's update."""

    def __init__(self, config, *, family: str = DEFAULT_FAMILY, spec: str = "auto",
                 optimizer_config: OptimizerConfig | None = None,
                 ddp_config: DistributedDataParallelConfig | None = None,
                 fast_paths: FastPaths | None = None, lora: LoRASettings | None = None,
                 lr_schedule: LRSchedule | None = None):
        fast = FastPaths() if fast_paths is None else fast_paths
        chunks = _build_chunks(config, family, spec, lora)
        if ddp_config is None:
            distributed = optimizer_config is not None and optimizer_config.use_distributed_optimizer
            ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed)
        on = select_fast_paths(fast, config, ddp_config, has_optimizer=optimizer_config is not None)
        ddp_cls = SingleRankDDP if on["single_rank_grads"] else DistributedDataParallel
        super().__init__(config, family, [ddp_cls(config, ddp_config, c, disable_bucketing=i > 0)
                                          for i, c in enumerate(chunks)])
        config.finalize_model_grads_func = None if on["single_rank_finalize"] else finalize_model_grads
        patches = apply_perf_patches(skip=set(PERF_PATCHES) - set(fast.megatron_patches))
        self.fast_paths_active = sorted([n for n, v in on.items() if v] + [p for p in patches if p in fast.megatron_patches])
        self.optimizer = get_megatron_optimizer(optimizer_config, self.model) if optimizer_config else None
        if self.optimizer is not None:
            config.grad_scale_func = self.optimizer.scale_loss
            use_foreach_torch_adam(self.optimizer, joint_groups=on["joint_adam_groups"])
        self.lora = lora
        self.lora_map = lora_weight_map(self.family.weight_map, lora) if lora is not None else None
        self.lr_schedule = lr_schedule

    def schedule_lr(self, iteration: int) -> dict:
        """Before iteration ``iteration``'s optimizer steps: every param group at the schedule's lr for it;
        ``{"lr": lr}`` for the update's metrics ({} without a schedule: the optimizer keeps its lr)."""
        if self.lr_schedule is None:
            return {}
        lr = self.lr_schedule.at(iteration)
        set_lr(self.optimizer, lr)
        return {"lr": lr}

    def load_diffusers_state_dict(self, diffusers_sd: dict[str, torch.Tensor]) -> None:
        """``ModelRunner.load_diffusers_state_dict``, then the optimizer's main params re-read."""
        super().load_diffusers_state_dict(diffusers_sd)
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    def load_adapters(self, diffusers_lora_sd: dict[str, torch.Tensor]) -> None:
        """Set the LoRA adapters from a PEFT/diffusers adapter state dict (``<module>.lora_A.weight`` ...,
        no ``transformer.`` prefix); ValueError names the first missing, unexpected or mis-shaped tensor."""
        if self.lora is None:
            raise ValueError("load_adapters needs a LoRA trainer (lora.rank > 0)")
        full = self.lora_map.to_megatron_full(diffusers_lora_sd, self.config)
        for chunk, local in self._local_shards(self.lora_map, full):
            own = adapter_state(chunk)
            for name, tensor in local.items():
                if tuple(tensor.shape) != tuple(own[name].shape):
                    raise ValueError(f"LoRA tensor {name!r}: shape {tuple(tensor.shape)}, the model's adapter "
                                     f"is {tuple(own[name].shape)} (rank or targets differ)")
            chunk.load_state_dict(local, strict=False)
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    def iter_full_adapters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (PEFT/diffusers name, full tensor) for every LoRA adapter tensor (collective, like
        ``iter_full_params``; names as ``<module>.lora_A.weight``)."""
        if self.lora is None:
            raise ValueError("iter_full_adapters needs a LoRA trainer (lora.rank > 0)")
        gathered = iter_full(self, lambda chunk: dict(chunk.named_parameters()), include_buffers=False,
                             weight_map=self.lora_map)
        for name, tensor in gathered:
            yield from self.lora_map.megatron_to_diffusers(name, tensor, self.config)

    def forward_backward(self, microbatches: list[dict], loss_fn: LossFn | None, *,
                         forward_only: bool = False) -> list:
        """``ModelRunner.forward_backward``; with backward, the DDP grad buffers are zeroed first."""
        if not forward_only:
            for m in self.model:
                m.zero_grad_buffer()
        return super().forward_backward(microbatches, loss_fn, forward_only=forward_only)

    def train_step(self, microbatches: list[dict], loss_fn: LossFn = rectified_flow_loss) -> dict:
        """zero grads -> forward/backward over all microbatches -> optimizer step.

        Returns {"loss": mean over microbatches (on every rank), "grad_norm", "update_ok"}."""
        assert self.optimizer is not None, "Trainer was built without an optimizer"
        self.optimizer.zero_grad()
        results = self.forward_backward(microbatches, loss_fn)
        update_ok, grad_norm, _ = self.optimizer.step()
        loss = torch.stack([r["loss"] for r in results]).mean() if results else torch.zeros(())
        return {"loss": _from_last_stage(loss.float()), "grad_norm": grad_norm, "update_ok": update_ok}

    def iter_full_grads(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Like ``iter_full_params`` for the accumulated grads (``main_grad``; non-distributed DDP)."""
        yield from iter_full(self, lambda chunk: {n: p.main_grad for n, p in chunk.named_parameters()},
                             include_buffers=False)


class ReferenceModel(ModelRunner):
    """A frozen, forward-only copy of the policy (the KL reference), same TP/PP shard layout as the trainer, no
    DDP, grad buffer or optimizer; ``forward_backward`` only with ``forward_only=True``."""

    def __init__(self, config, *, family: str = DEFAULT_FAMILY, spec: str = "auto"):
        chunks = _build_chunks(config, family, spec)
        for c in chunks:
            c.requires_grad_(False)
        super().__init__(config, family, chunks)

    def forward_backward(self, microbatches: list[dict], loss_fn: LossFn | None, *,
                         forward_only: bool = False) -> list:
        """``ModelRunner.forward_backward`` with ``forward_only=True`` (required: nothing here trains)."""
        if not forward_only:
            raise ValueError("ReferenceModel is frozen: call forward_backward(..., forward_only=True)")
        return super().forward_backward(microbatches, loss_fn, forward_only=True)


class BaseReference:
    """The KL reference of a LoRA ``Trainer``: the same trainer with its adapters switched off (the frozen
    base), forward only; no second model. Same ``forward_backward`` contract as ``ReferenceModel``."""

    def __init__(self, trainer: Trainer):
        if trainer.lora is None:
            raise ValueError("BaseReference needs a LoRA trainer; use ReferenceModel for full-parameter training")
        self.trainer = trainer

    def forward_backward(self, microbatches: list[dict], loss_fn: LossFn | None, *,
                         forward_only: bool = False) -> list:
        if not forward_only:
            raise ValueError("BaseReference is frozen: call forward_backward(..., forward_only=True)")
        with adapters_disabled(self.trainer.chunks):
            return self.trainer.forward_backward(microbatches, loss_fn, forward_only=True)


def _megatron_loss(loss_fn: LossFn, microbatch: dict, output: torch.Tensor):
    loss, metrics = loss_fn(output, microbatch)
    return loss, metrics


def _from_last_stage(value: torch.Tensor) -> torch.Tensor:
    """Broadcast a scalar computed on the last pipeline stage to every stage."""
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return value
    value = value.clone() if ps.is_pipeline_last_stage(ignore_virtual=True) else torch.zeros_like(value)
    torch.distributed.all_reduce(value, group=ps.get_pipeline_model_parallel_group())
    return value
