"""Megatron training engine for a flow-matching DiT: model + DDP + optimizer, one training step
through megatron's ``get_forward_backward_func`` (so TP/SP/PP/VPP/DP all apply), a per-timestep
velocity forward, and ``iter_full_params`` (full tensors gathered over TP and PP, one at a time).

Microbatch protocol (a dict per microbatch; every rank receives the same list):
    latents [B, C, H, W]  model input x_t          sigma [B]  noise level in [0, 1]
    encoder_hidden_states [B, L, D]                 pooled_projections [B, P]
    ...any extra keys the loss function reads (e.g. ``target``).
A loss function is ``loss_fn(velocity, microbatch) -> (scalar loss, {name: detached tensor})``;
it runs on the last pipeline stage, where ``velocity`` carries grads.

A one-process job skips the data-parallel machinery that has nothing to do there (``FastPaths``:
bit-identical grads and updates, each switchable).

Launch (each process builds its shard; ``megaflow.parallel.init_distributed`` first)::

    python train.py                               # 1 process
    torchrun --nproc-per-node 4 train.py          # e.g. ParallelDims(tp=2, pp=2)
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from megaflow.models.provider import build_model_chunks
from megaflow.models.registry import get_family
from megaflow.parallel import current_device
from megaflow.parallel.cpu import PERF_PATCHES, apply_perf_patches

LossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]]


def adam_config(*, lr: float, weight_decay: float = 0.0, grad_clip: float = 1.0, betas=(0.9, 0.999),
                eps: float = 1e-8, distributed: bool = True, bf16: bool = False) -> OptimizerConfig:
    """megatron Adam(W) config (decoupled weight decay); ``distributed`` = ZeRO-1 DistributedOptimizer."""
    return OptimizerConfig(
        optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=grad_clip, adam_beta1=betas[0],
        adam_beta2=betas[1], adam_eps=eps, use_distributed_optimizer=distributed, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
    )


def rectified_flow_microbatch(x0, noise, sigma, encoder_hidden_states, pooled_projections) -> dict:
    """SFT microbatch: x_t = (1 - sigma) x0 + sigma noise, target velocity v = noise - x0."""
    s = sigma.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return {
        "latents": (1 - s) * x0 + s * noise, "sigma": sigma, "target": noise - x0,
        "encoder_hidden_states": encoder_hidden_states, "pooled_projections": pooled_projections,
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


class TrainEngine:
    """This rank's model chunks (DDP-wrapped), optimizer and step functions.

    ``optimizer_config=None`` builds no optimizer (forward / grads only). ``ddp_config`` defaults to
    fp32 grad reduction, bucketed, distributed-optimizer layout iff the optimizer is distributed.
    ``fast_paths`` (default: all on) picks the bit-identical shortcuts below (see ``FastPaths``);
    ``self.fast_paths_active`` names the ones in effect.
    """

    def __init__(self, config, *, family: str = "sd3", spec: str = "auto",
                 optimizer_config: OptimizerConfig | None = None,
                 ddp_config: DistributedDataParallelConfig | None = None,
                 fast_paths: FastPaths | None = None):
        self.config, self.family = config, get_family(family)
        fast = FastPaths() if fast_paths is None else fast_paths
        chunks = build_model_chunks(config, family=family, spec=spec)
        if config.bf16 or config.fp16:
            chunks = [Float16Module(config, c) for c in chunks]
        if ddp_config is None:
            distributed = optimizer_config is not None and optimizer_config.use_distributed_optimizer
            ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed)
        single = _single_process()
        on = {"single_rank_grads": fast.single_rank_grads and single and _grads_can_bypass_buffer(config, ddp_config),
              "single_rank_finalize": fast.single_rank_finalize and single and _finalize_is_identity(config, ddp_config),
              "joint_adam_groups": fast.joint_adam_groups and optimizer_config is not None}
        ddp_cls = SingleRankDDP if on["single_rank_grads"] else DistributedDataParallel
        self.model = [ddp_cls(config, ddp_config, c, disable_bucketing=i > 0) for i, c in enumerate(chunks)]
        config.finalize_model_grads_func = None if on["single_rank_finalize"] else finalize_model_grads
        patches = apply_perf_patches(skip=set(PERF_PATCHES) - set(fast.megatron_patches))
        self.fast_paths_active = sorted([n for n, v in on.items() if v] + [p for p in patches if p in fast.megatron_patches])
        self.optimizer = get_megatron_optimizer(optimizer_config, self.model) if optimizer_config else None
        if self.optimizer is not None:
            config.grad_scale_func = self.optimizer.scale_loss
            _use_foreach_torch_adam(self.optimizer, joint_groups=on["joint_adam_groups"])

    @property
    def chunks(self) -> list[torch.nn.Module]:
        """Unwrapped model chunks (one per virtual pipeline stage)."""
        return [unwrap(m) for m in self.model]

    # ---- weights in -------------------------------------------------------------------------
    def load_diffusers_state_dict(self, diffusers_sd: dict[str, torch.Tensor]) -> None:
        """Load full diffusers weights: each rank takes its TP shard of its stage's tensors.

        ValueError names the first tensor whose shape does not match the model."""
        wm = self.family.weight_map
        full = wm.to_megatron_full(diffusers_sd, self.config)
        tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        for chunk in self.chunks:
            local = wm.select_local(full, self.config, tp_rank=tp_rank, tp_size=tp_size,
                                    pp_rank=chunk.pp_rank, vp_stage=chunk.vp_stage)
            load_checked(chunk, local)
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    # ---- steps --------------------------------------------------------------------------------
    def forward_backward(self, microbatches: list[dict], loss_fn: LossFn | None, *,
                         forward_only: bool = False) -> list:
        """Run megatron's schedule over ``microbatches``; returns, on the last pipeline stage, the
        loss functions' metric dicts (or the raw velocities when ``loss_fn`` is None), else []."""
        first = microbatches[0]
        seq_length = self.family.microbatch_seq_length(self.config, first)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            out = model(**self.family.model_inputs(self.config, mb))
            return out, (partial(_megatron_loss, loss_fn, mb) if loss_fn is not None else None)

        if not forward_only:
            for m in self.model:
                m.zero_grad_buffer()
        iterators = [iter(microbatches) for _ in self.model]
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=self.model, num_microbatches=len(microbatches), seq_length=seq_length,
            micro_batch_size=first["latents"].shape[0], forward_only=forward_only,
        )

    def train_step(self, microbatches: list[dict], loss_fn: LossFn = rectified_flow_loss) -> dict:
        """zero grads -> forward/backward over all microbatches -> optimizer step.

        Returns {"loss": mean over microbatches (on every rank), "grad_norm", "update_ok"}."""
        assert self.optimizer is not None, "TrainEngine was built without an optimizer"
        self.optimizer.zero_grad()
        results = self.forward_backward(microbatches, loss_fn)
        update_ok, grad_norm, _ = self.optimizer.step()
        loss = torch.stack([r["loss"] for r in results]).mean() if results else torch.zeros(())
        return {"loss": _from_last_stage(loss.float()), "grad_norm": grad_norm, "update_ok": update_ok}

    @torch.no_grad()
    def velocity(self, latents, sigma, encoder_hidden_states, pooled_projections) -> torch.Tensor | None:
        """Per-timestep forward v(x_t, sigma | conditioning): the velocity [B, C, H, W] on the last
        pipeline stage, None on other stages. The batch runs as one microbatch, or as PP equal
        microbatches under interleaved (VPP) pipelining, which needs at least PP of them."""
        num = 1
        if self.config.virtual_pipeline_model_parallel_size is not None:
            num = self.config.pipeline_model_parallel_size
            if latents.shape[0] % num:
                raise ValueError(f"batch {latents.shape[0]} must be divisible by pp={num} with virtual pipelining")
        parts = zip(*(t.chunk(num) for t in (latents, sigma, encoder_hidden_states, pooled_projections)))
        mbs = [dict(zip(("latents", "sigma", "encoder_hidden_states", "pooled_projections"), p)) for p in parts]
        out = self.forward_backward(mbs, None, forward_only=True)
        return torch.cat(out) if out else None

    # ---- weights out --------------------------------------------------------------------------
    def iter_full_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (global megatron name, full tensor) for every weight, one tensor at a time.

        Collective: every rank of the model-parallel group must iterate it to the end together;
        each yields the same sequence (TP all-gather, then broadcast from the owning PP stage).
        Zero-copy where possible: a replicated tensor on its own stage IS the live parameter
        (detached), valid until the next optimizer step -- ``.clone()`` what you keep."""
        yield from iter_full(self, lambda chunk: {**dict(chunk.named_parameters()), **dict(chunk.named_buffers())})

    def iter_full_grads(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Like ``iter_full_params`` for the accumulated grads (``main_grad``; non-distributed DDP)."""
        yield from iter_full(self, lambda chunk: {n: p.main_grad for n, p in chunk.named_parameters()},
                             include_buffers=False)


# ---- fast paths ---------------------------------------------------------------------------------
# Same work, done cheaper, with bit-identical grads and updates (tests/trainer/test_fast_paths.py).
# The single_rank_* ones apply only when this process is the whole job (world size 1), where
# megatron's data-parallel machinery has nothing to communicate but still runs; multi-process
# layouts use megatron's code unchanged.


@dataclass(frozen=True, kw_only=True)
class FastPaths:
    """Which shortcuts TrainEngine takes (each individually switchable; all on by default)."""

    single_rank_grads: bool = True
    """Grads stay where autograd accumulates them (``SingleRankDDP``): no per-parameter Python hook
    copying each fresh ``param.grad`` into DDP's contiguous buffer, which exists to be reduced."""
    single_rank_finalize: bool = True
    """No ``finalize_model_grads``: with one process every collective in it is over a size-1 group
    (identity). Only where it has no other work (see ``_finalize_is_identity``)."""
    joint_adam_groups: bool = True
    """torch Adam(W) steps megatron's param groups with equal hyperparameters in one call
    (``_JointGroupStep``); any layout."""
    megatron_patches: frozenset[str] = frozenset(PERF_PATCHES)
    """Which of ``megaflow.parallel.cpu.PERF_PATCHES`` to apply (process-wide, idempotent; leaving
    one out does not remove it if something else applied it)."""


def _single_process() -> bool:
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1


def _finalize_is_identity(config, ddp_config: DistributedDataParallelConfig) -> bool:
    """Whether ``finalize_model_grads`` does nothing but size-1 collectives in a one-process job:
    no per-token loss scaling, no MoE router updates, no async grad/param sync to wait for, no
    separate fp32 main_grads to copy back."""
    return (not config.calculate_per_token_loss and config.num_moe_experts is None
            and not getattr(config, "flextron", False) and not ddp_config.overlap_grad_reduce
            and not ddp_config.overlap_param_gather
            and not ddp_config.param_name_patterns_for_fp32_local_accumulation)


def _grads_can_bypass_buffer(config, ddp_config: DistributedDataParallelConfig) -> bool:
    """Whether nothing in a one-process step reads or writes DDP's grad buffer except through
    ``param.main_grad``: no reduction during backward, no distributed optimizer (it reads buffer
    shards), no buffer-wide NaN check or per-token scaling, no fused or delayed wgrad writing into
    main_grad, no CUDA-graph replay."""
    return (_finalize_is_identity(config, ddp_config) and not ddp_config.use_distributed_optimizer
            and not ddp_config.check_for_nan_in_grad and not ddp_config.check_for_large_grads
            and not ddp_config.delay_wgrad_compute and not config.gradient_accumulation_fusion
            and getattr(config, "cuda_graph_impl", "none") == "none")


class SingleRankDDP(DistributedDataParallel):
    """megatron's DDP for a one-process job: grads stay where autograd accumulates them.

    DDP's contiguous grad buffer exists to be all-reduced / reduce-scattered. megatron fills it with
    a Python hook per parameter, run by autograd after each grad accumulation, that adds the fresh
    ``param.grad`` into ``param.main_grad`` (a view of the buffer) and drops it. With one process
    there is nothing to reduce, so here those hooks are gone and, once per backward (a callback
    queued by a hook on the model output), ``param.main_grad`` is bound to ``param.grad``, which
    autograd keeps accumulating into over microbatches. Same numbers (megatron's 0 + g1 + g2 ...
    vs g1 + g2 ...: adding to an exact zero is exact); no copy, no hook calls, no second grad.
    ``zero_grad_buffer`` drops the grads and re-binds ``main_grad`` to the buffer views, which a
    parameter that gets no grad keeps. Nothing writes those views any more, so instead of zeroing
    the whole buffer (megatron) it zeroes only views that were still bound as ``main_grad``, i.e.
    handed out beyond the backward window (to the optimizer, which may scale them in place).

    Covers parameters whose grad buffer has their dtype (fp32 params, fp32 grads); with any other,
    that one keeps megatron's hook and the buffer is zeroed as usual. Backward must pass through
    this module's output (any loss of it does); as with megatron's DDP, ``main_grad`` is the grad
    only after backward (writing into it before backward is not supported). Use only where
    ``_grads_can_bypass_buffer`` holds (TrainEngine checks)."""

    def __init__(self, config, ddp_config, module, **kwargs):
        if ddp_config.overlap_grad_reduce or ddp_config.use_distributed_optimizer:
            raise ValueError("SingleRankDDP needs overlap_grad_reduce=False and no distributed optimizer")
        super().__init__(config, ddp_config, module, **kwargs)
        self.buffer_views = {p: p.main_grad for p in self.params_with_grad if p.main_grad.dtype == p.dtype}
        self.covers_all = len(self.buffer_views) == len(self.params_with_grad)
        # megatron's hooks hang on the AccumulateGrad nodes it keeps alive in grad_accs; a parameter
        # holds its node only weakly, so dropping these references drops the hooks with the nodes.
        self.grad_accs = [acc for acc in self.grad_accs if acc.variable not in self.buffer_views]

    def forward(self, *inputs, **kwargs):
        out = super().forward(*inputs, **kwargs)
        if torch.is_grad_enabled():
            first = next((t for t in (out if isinstance(out, (tuple, list)) else (out,))
                          if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if first is not None:
                first.register_hook(self._queue_bind_main_grads)
        return out

    def _queue_bind_main_grads(self, grad):
        torch.autograd.Variable._execution_engine.queue_callback(self.bind_main_grads)

    def bind_main_grads(self) -> None:
        """``main_grad = grad`` for every covered parameter that has a grad (runs after backward)."""
        for p in self.buffer_views:
            if p.grad is not None:
                p.main_grad = p.grad

    def zero_grad_buffer(self):
        if self.covers_all:  # megatron's zero_grad_buffer minus zeroing the (unwritten) buffer
            handed_out = [view for p, view in self.buffer_views.items() if p.main_grad is view]
            if handed_out:
                torch._foreach_zero_(handed_out)
            for p in self.params_with_grad:
                p.grad_added_to_main_grad = False
            for bucket_group in self.bucket_groups + self.expert_parallel_bucket_groups:
                bucket_group.reset()
        else:
            super().zero_grad_buffer()
        for p, view in self.buffer_views.items():
            p.grad = None
            p.main_grad = view


def _use_foreach_torch_adam(optimizer, *, joint_groups: bool) -> None:
    """Without apex/TE megatron falls back to ``torch.optim.AdamW`` with default arguments, which
    on CPU tensors means the per-tensor loop; switch its groups to the multi-tensor (foreach)
    implementation (same math; measured ~1.4x faster step on the tiny CPU model). With
    ``joint_groups``, also step equal-hyperparameter groups together (``_JointGroupStep``)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            for group in inner.param_groups:
                if group.get("foreach") is None and not group.get("fused"):
                    group["foreach"] = True
            if joint_groups and not isinstance(inner.step, _JointGroupStep):
                inner.step = _JointGroupStep(inner)


class _JointGroupStep:
    """A torch Adam(W)'s ``step`` that runs param groups whose Adam hyperparameters are all equal
    as one group: megatron splits params into weight-decay / no-weight-decay groups (plus lr_mult
    and expert groups), which with equal settings (e.g. weight_decay=0) only doubles the foreach
    kernel launches and Python set-up (measured +7% of the Adam step on the bench model). Adam is
    elementwise per tensor, so the update is bit-identical; state stays keyed by parameter and the
    groups are restored after the step (checkpoints and LR schedules see megatron's groups)."""

    def __init__(self, inner: torch.optim.Optimizer):
        self.inner, self.step, self.keys = inner, inner.step, tuple(inner.defaults)

    def __call__(self, closure=None):
        groups = self.inner.param_groups
        joint: dict[tuple, list[dict]] = {}
        try:
            for g in groups:
                joint.setdefault(tuple(g[k] for k in self.keys), []).append(g)
        except TypeError:  # an unhashable hyperparameter value: step group by group
            return self.step(closure)
        if len(joint) == len(groups):
            return self.step(closure)
        self.inner.param_groups = [{**gs[0], "params": [p for g in gs for p in g["params"]]} for gs in joint.values()]
        try:
            return self.step(closure)
        finally:
            self.inner.param_groups = groups


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


def load_checked(chunk: torch.nn.Module, local_sd: dict[str, torch.Tensor]) -> None:
    """``load_state_dict(strict)`` with a one-line ValueError naming the first mismatched tensor."""
    own = {k: v for k, v in chunk.state_dict().items() if not k.endswith("_extra_state")}
    for name in own:
        if name not in local_sd:
            raise ValueError(f"tensor {name!r} is missing from the weights")
        if tuple(local_sd[name].shape) != tuple(own[name].shape):
            raise ValueError(f"shape mismatch for {name!r}: weights {tuple(local_sd[name].shape)} vs model {tuple(own[name].shape)}")
    extra = [k for k in local_sd if k not in own]
    if extra:
        raise ValueError(f"unexpected tensor {extra[0]!r} for this model")
    chunk.load_state_dict(local_sd, strict=False)


def _owner_table(wm, config) -> dict:
    """"first" / "last" / global block index -> (pp rank, chunk index) that holds it."""
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    stages = [None] if vpp is None else list(range(vpp))
    owners = {i: (r, c) for r in range(pp) for c, v in enumerate(stages) for i in wm.stage_layers(config, r, v)}
    return {"first": (0, 0), "last": (pp - 1, len(stages) - 1), **owners}


def iter_full(engine: TrainEngine, local_tensors: Callable[[torch.nn.Module], dict], *,
              include_buffers: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Shared gather loop of iter_full_params / iter_full_grads (see there)."""
    wm, cfg = engine.family.weight_map, engine.config
    owners = _owner_table(wm, cfg)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    tp_group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    pp_group, pp_size = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_world_size()
    chunks = engine.chunks
    tables = [local_tensors(c) for c in chunks]
    for m in wm.param_maps(cfg):
        if m.buffer and not include_buffers:
            continue
        owner_pp, chunk_idx = owners[m.layer if m.layer is not None else m.stage]
        full = None
        if owner_pp == pp_rank:
            local_name = m.megatron
            if m.layer is not None:
                start = chunks[chunk_idx].global_layer_numbers[0]
                local_name = m.megatron.replace(f"layers.{m.layer}.", f"layers.{m.layer - start}.", 1)
            full = tables[chunk_idx][local_name].detach()
            if m.split_dim is not None and tp > 1:
                parts = [torch.empty_like(full) for _ in range(tp)]
                torch.distributed.all_gather(parts, full.contiguous(), group=tp_group)
                full = torch.cat(parts, dim=m.split_dim)
        if pp_size > 1:
            src = torch.distributed.get_global_rank(pp_group, owner_pp)
            meta = [(tuple(full.shape), full.dtype) if full is not None else None]
            torch.distributed.broadcast_object_list(meta, src=src, group=pp_group)
            if full is None:
                full = torch.empty(meta[0][0], dtype=meta[0][1], device=current_device())
            torch.distributed.broadcast(full, src=src, group=pp_group)
        yield m.megatron, full
