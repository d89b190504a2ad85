"""Pipeline-stage bookkeeping and embedders shared by the DiT family models.

Design notes: docs/design/models.md.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.enums import ModelType
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, sharded_state_dict_default
from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

from megaflow.models.common.layers import ReplicatedLinear, layer_norm, modulate

TIMESTEP_CHANNELS = 256  # sinusoidal timestep features (diffusers Timesteps(num_channels=256))


def timestep_features(timestep: torch.Tensor, dim: int = TIMESTEP_CHANNELS, scale: float = 1.0) -> torch.Tensor:
    """Sinusoidal timestep features [B, dim], cos first (diffusers flip_sin_to_cos=True, shift 0); ``scale``
    multiplies the angles after the product, as diffusers' ``Timesteps(scale=...)`` does."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half)
    args = timestep[:, None].float() * freqs[None, :]
    if scale != 1.0:
        args = scale * args
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class EmbedMLP(torch.nn.Module):
    """linear_1 -> ``activation`` (SiLU) -> linear_2 (timestep, guidance and pooled-text embedders; Wan's
    text projection with GELU-tanh). ``sequence_parallel_grad``: the output is used on every rank's sequence
    shard (a conditioning vector), so its grads are summed over TP under SP; False for token embeddings
    that are scattered over the sequence afterwards."""

    def __init__(self, in_features: int, config: TransformerConfig, *,
                 activation: Callable[[torch.Tensor], torch.Tensor] = F.silu, sequence_parallel_grad: bool = True):
        super().__init__()
        h = config.hidden_size
        self.linear_1 = ReplicatedLinear(in_features, h, config=config, sequence_parallel_grad=sequence_parallel_grad)
        self.linear_2 = ReplicatedLinear(h, h, config=config, sequence_parallel_grad=sequence_parallel_grad)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.activation(self.linear_1(x)))


def pipeline_seq_length(config: TransformerConfig, num_image_tokens: int, num_context_tokens: int, *,
                        rows: int = 1) -> int:
    """``seq_length`` for megatron's pipeline schedule: image + context tokens + ``rows`` conditioning rows
    (one temb row; replicated on every rank, so tp times ``rows`` under SP, where the schedule divides by tp)."""
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    return num_image_tokens + num_context_tokens + rows * tp


def stage_layers(config: TransformerConfig, pp_rank: int, vp_stage: int | None = None) -> range:
    """Global block indices held by pipeline rank ``pp_rank`` (virtual chunk ``vp_stage``)."""
    offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
    return range(offset, offset + get_num_layers_to_build(config, vp_stage, pp_rank))


def recompute_blocks(config: TransformerConfig) -> int:
    """How many leading blocks of each chunk run under activation checkpointing (all for "full"/"uniform",
    ``recompute_num_layers`` for "block", else 0). ValueError for what DiT blocks cannot do."""
    granularity, method, num = config.recompute_granularity, config.recompute_method, config.recompute_num_layers
    if granularity is None:
        return 0
    if granularity != "full":
        raise ValueError(f"recompute_granularity={granularity!r}: the DiT blocks support only 'full' "
                         "(megatron's selective recompute lives inside its TransformerLayer)")
    if method == "uniform":
        if num != 1:
            raise ValueError(f"recompute_method='uniform' with recompute_num_layers={num}: the DiT blocks "
                             "checkpoint one block per unit (recompute_num_layers=1)")
        return 1 << 30
    return int(num)


def stage_ends(config: TransformerConfig, pp_rank: int, vp_stage: int | None = None) -> tuple[bool, bool]:
    """(first, last): whether pipeline rank ``pp_rank`` / chunk ``vp_stage`` is the first stage
    (holds the embeddings) and the last one (holds the final layer) of the whole model."""
    vpp = config.virtual_pipeline_model_parallel_size
    first = pp_rank == 0 and (vp_stage or 0) == 0
    last = pp_rank == config.pipeline_model_parallel_size - 1 and (vp_stage is None or vp_stage == (vpp or 1) - 1)
    return first, last


class DiTModel(MegatronModule):
    """One pipeline stage / virtual chunk of a DiT family model. Subclass ``__init__``: ``super().__init__``,
    ``_build_layers``, embeddings (if ``pre_process``), ``_build_final`` (if ``post_process``)."""

    def __init__(self, config: TransformerConfig, *, pp_rank: int | None = None, vp_stage: int | None = None):
        super().__init__(config=config)
        name = type(self).__name__
        if config.context_parallel_size > 1:
            raise ValueError(f"context_parallel_size={config.context_parallel_size}: {name} has no context parallelism yet")
        if pp_rank is None:
            pp_rank = parallel_state.get_pipeline_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0
        self.pp_rank, self.vp_stage = pp_rank, vp_stage
        self.pre_process, self.post_process = stage_ends(config, pp_rank, vp_stage)
        self._recompute_blocks = recompute_blocks(config)
        self.sequence_parallel = config.sequence_parallel and config.tensor_model_parallel_size > 1
        self.input_tensor: torch.Tensor | None = None
        # Read by megatron's schedules / finalize_model_grads (no tied embedding <-> output weights).
        self.model_type = ModelType.encoder_or_decoder
        self.share_embeddings_and_output_weights = False

    def _build_layers(self, spec_of: Callable[[int], ModuleSpec]) -> None:
        """``self.layers``: this chunk's blocks; ``spec_of(global 0-based index)`` is a block's spec."""
        self.layers = torch.nn.ModuleList([
            build_module(spec_of(i), config=self.config, layer_number=i + 1)
            for i in stage_layers(self.config, self.pp_rank, self.vp_stage)
        ])

    def _build_final(self) -> None:
        """The last stage's final adaLN (scale, shift) and projection to ``config.patch_dim``."""
        h = self.config.hidden_size
        self.final_adaln = ReplicatedLinear(h, 2 * h, config=self.config, sequence_parallel_grad=True)
        self.final_proj = ReplicatedLinear(h, self.config.patch_dim, config=self.config, sequence_parallel_grad=True)

    def _run_layer(self, index: int, layer: torch.nn.Module, *tensors: torch.Tensor, **static):
        """``layer(*tensors, **static)`` for this chunk's block ``index``, under ``tensor_parallel.checkpoint``
        when that block is recomputed and autograd records; ``static`` (non-tensors) stays in the closure."""
        if index >= self._recompute_blocks or not torch.is_grad_enabled():
            return layer(*tensors, **static)
        return tensor_parallel.checkpoint(partial(layer, **static) if static else layer, False, *tensors)

    @property
    def global_layer_numbers(self) -> list[int]:
        """0-based global indices of the blocks this chunk holds."""
        return [layer.layer_number - 1 for layer in self.layers]

    def set_input_tensor(self, input_tensor) -> None:
        """Called by megatron's pipeline schedule with the tensor received from the previous stage."""
        if isinstance(input_tensor, (list, tuple)):
            assert len(input_tensor) == 1, f"{type(self).__name__} takes one packed tensor per stage"
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def _check_sp_divisible(self, num_image: int, num_context: int) -> None:
        """ValueError unless both token streams split evenly over TP (with sequence parallelism)."""
        tp = self.config.tensor_model_parallel_size
        if self.sequence_parallel and (num_image % tp or num_context % tp):
            raise ValueError(f"sequence parallelism needs image tokens ({num_image}) and context "
                             f"tokens ({num_context}) divisible by tp={tp}")

    def _scatter(self, *streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each [s, B, h] stream split on the sequence dim over TP (unchanged without SP)."""
        if not self.sequence_parallel:
            return streams
        return tuple(scatter_to_sequence_parallel_region(s) for s in streams)

    def _final_tokens(self, hidden: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """Final adaLN (AdaLayerNormContinuous: scale, then shift) and projection: image tokens
        [N(/tp), B, h] -> [N, B, patch_dim], gathered over TP with sequence parallelism."""
        scale, shift = self.final_adaln(F.silu(temb)).chunk(2, dim=-1)
        out = self.final_proj(modulate(layer_norm(hidden, self.config.layernorm_epsilon), shift, scale))
        if self.sequence_parallel:
            out = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False)
        return out

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Sharded state dict with GLOBAL block indices, so a checkpoint loads at another TP/PP layout;
        each (heterogeneous) block is its own set of tensors."""
        assert not sharded_offsets, f"{type(self).__name__} is the top-level module"
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        tp_group = parallel_state.get_tensor_model_parallel_group()  # replica ids of replicated tensors
        out = {}
        for name, child in self.named_children():
            if name != "layers":
                out.update(sharded_state_dict_default(child, f"{prefix}{name}.", (), metadata, tp_group=tp_group))
        for local_index, layer in enumerate(self.layers):
            local_prefix = f"{prefix}layers.{local_index}."
            layer_sd = layer.sharded_state_dict(local_prefix, (), metadata)
            replace_prefix_for_sharding(layer_sd, local_prefix, f"{prefix}layers.{layer.layer_number - 1}.")
            out.update(layer_sd)
        return _shard_adapters(out)


def _shard_adapters(sharded: dict) -> dict:
    """TP-sharded state-dict entries for LoRA adapter tensors split over TP (megatron calls them replicated)."""
    for key, sh in sharded.items():
        dim = getattr(getattr(sh, "data", None), "lora_split_dim", None)
        if dim is not None:
            sharded[key] = make_tp_sharded_tensor_for_checkpoint(sh.data, sh.key, tp_axis=dim)
    return sharded
