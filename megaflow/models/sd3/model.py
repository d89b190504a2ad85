"""SD3 MMDiT as a megatron-core model: embeddings on the first pipeline stage, a slice of MMDiT
blocks per stage, the final adaLN + projection on the last stage.

Inputs follow diffusers' ``SD3Transformer2DModel.forward``: latents [B, C, H, W], timestep [B]
(= sigma * num_train_timesteps), encoder_hidden_states [B, L, joint_attention_dim],
pooled_projections [B, pooled_projection_dim]; output: velocity [B, C, H, W] on the last stage.

Inside, activations are sequence-first ([tokens, B, h], megatron's layout). Between pipeline
stages the three streams travel as ONE tensor ``[image; context; temb]`` of shape
[N + L + 1, B, h] (temb as one extra row), so megatron's p2p schedule moves them unchanged and
the timestep embedding's grads flow back to the first stage. With sequence parallelism the image
and context rows are each split over TP and the temb row is replicated: use
``pipeline_seq_length`` for the schedule's ``seq_length``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.enums import ModelType
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, sharded_state_dict_default

from megaflow.models.sd3.config import MMDiTConfig
from megaflow.models.sd3.layers import ReplicatedLinear, _modulate

TIMESTEP_CHANNELS = 256  # sinusoidal timestep features (diffusers Timesteps(num_channels=256))


def timestep_features(timestep: torch.Tensor, dim: int = TIMESTEP_CHANNELS) -> torch.Tensor:
    """Sinusoidal timestep features [B, dim], cos first (diffusers flip_sin_to_cos=True, shift 0)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half)
    args = timestep[:, None].float() * freqs[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def sincos_pos_grid(dim: int, grid: int, base_size: int) -> torch.Tensor:
    """SD3's 2-D sin-cos position table [grid*grid, dim] (diffusers get_2d_sincos_pos_embed)."""
    if dim % 4:
        raise ValueError(f"hidden size {dim} must be divisible by 4 for the 2-D sin-cos position table")
    coords = torch.arange(grid, dtype=torch.float32) / (grid / base_size)
    col, row = torch.meshgrid(coords, coords, indexing="xy")  # [i, j] -> (coords[j], coords[i])
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4.0))

    def embed_1d(pos):
        out = torch.outer(pos.reshape(-1).double(), omega)
        return torch.cat([torch.sin(out), torch.cos(out)], dim=1)

    return torch.cat([embed_1d(col), embed_1d(row)], dim=1).float()  # column half first, as diffusers


class PatchEmbed(torch.nn.Module):
    """Conv patchify + centred crop of the stored sin-cos table: [B, C, H, W] -> [N, B, h]."""

    def __init__(self, config: MMDiTConfig):
        super().__init__()
        p, h = config.patch_size, config.hidden_size
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.proj = torch.nn.Conv2d(config.in_channels, h, kernel_size=p, stride=p, device=device,
                                    dtype=config.params_dtype)
        grid = sincos_pos_grid(h, config.pos_embed_max_size, config.sample_size // p)
        grid = grid.unsqueeze(0) if device is None else grid.unsqueeze(0).to(device)
        self.register_buffer("pos_embed", grid, persistent=True)
        self.patch_size, self.max_size = p, config.pos_embed_max_size

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        gh, gw = latents.shape[-2] // self.patch_size, latents.shape[-1] // self.patch_size
        if gh > self.max_size or gw > self.max_size:
            raise ValueError(f"latent grid {gh}x{gw} exceeds pos_embed_max_size={self.max_size}")
        top, left = (self.max_size - gh) // 2, (self.max_size - gw) // 2
        pos = self.pos_embed.view(self.max_size, self.max_size, -1)[top:top + gh, left:left + gw]
        x = self.proj(latents).flatten(2).permute(2, 0, 1)  # [N, B, h]
        return (x + pos.reshape(gh * gw, 1, -1)).to(x.dtype)


class EmbedMLP(torch.nn.Module):
    """linear_1 -> SiLU -> linear_2 (timestep and pooled-text embedders)."""

    def __init__(self, in_features: int, config: MMDiTConfig):
        super().__init__()
        h = config.hidden_size
        self.linear_1 = ReplicatedLinear(in_features, h, config=config, sequence_parallel_grad=True)
        self.linear_2 = ReplicatedLinear(h, h, config=config, sequence_parallel_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


def pipeline_seq_length(config: MMDiTConfig, num_image_tokens: int, num_context_tokens: int) -> int:
    """``seq_length`` for megatron's pipeline schedule so that the p2p tensor is [image; context;
    temb] on each rank (with SP: N/tp + L/tp + 1 rows, i.e. seq_length // tp)."""
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    return num_image_tokens + num_context_tokens + tp


class SD3MMDiT(MegatronModule):
    """The SD3 / SD3.5 MMDiT on megatron-core (one pipeline stage / virtual chunk of it)."""

    def __init__(self, config: MMDiTConfig, layer_spec: ModuleSpec, *, pp_rank: int | None = None,
                 vp_stage: int | None = None):
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise ValueError(f"context_parallel_size={config.context_parallel_size}: SD3MMDiT has no context parallelism yet")
        if pp_rank is None:
            pp_rank = parallel_state.get_pipeline_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0
        pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
        self.pp_rank, self.vp_stage = pp_rank, vp_stage
        self.pre_process = pp_rank == 0 and (vp_stage or 0) == 0
        self.post_process = pp_rank == pp - 1 and (vp_stage is None or vp_stage == (vpp or 1) - 1)
        self.sequence_parallel = config.sequence_parallel and config.tensor_model_parallel_size > 1
        offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
        count = get_num_layers_to_build(config, vp_stage, pp_rank)
        self.layers = torch.nn.ModuleList(
            [build_module(layer_spec, config=config, layer_number=offset + i + 1) for i in range(count)]
        )
        if self.pre_process:
            self.patch_embed = PatchEmbed(config)
            self.time_embed = EmbedMLP(TIMESTEP_CHANNELS, config)
            self.text_embed = EmbedMLP(config.pooled_projection_dim, config)
            self.context_embed = ReplicatedLinear(config.joint_attention_dim, config.hidden_size, config=config)
        if self.post_process:
            h = config.hidden_size
            self.final_adaln = ReplicatedLinear(h, 2 * h, config=config, sequence_parallel_grad=True)
            self.final_proj = ReplicatedLinear(h, config.patch_dim, config=config, sequence_parallel_grad=True)
        self.input_tensor: torch.Tensor | None = None
        # Read by megatron's schedules / finalize_model_grads (no tied embedding <-> output weights).
        self.model_type = ModelType.encoder_or_decoder
        self.share_embeddings_and_output_weights = False

    @property
    def global_layer_numbers(self) -> list[int]:
        """0-based global indices of the blocks this chunk holds."""
        return [layer.layer_number - 1 for layer in self.layers]

    def set_input_tensor(self, input_tensor) -> None:
        """Called by megatron's pipeline schedule with the tensor received from the previous stage."""
        if isinstance(input_tensor, (list, tuple)):
            assert len(input_tensor) == 1, "SD3MMDiT takes one packed tensor per stage"
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def _embed(self, latents, timestep, encoder_hidden_states, pooled_projections):
        dtype = self.config.params_dtype  # inputs in model precision; the timestep stays as given
        latents, encoder_hidden_states = latents.to(dtype), encoder_hidden_states.to(dtype)
        pooled_projections = pooled_projections.to(dtype)
        hidden = self.patch_embed(latents)
        context = self.context_embed(encoder_hidden_states.transpose(0, 1))  # [L, B, h]
        temb = self.time_embed(timestep_features(timestep).to(pooled_projections.dtype))
        temb = temb + self.text_embed(pooled_projections)
        if self.sequence_parallel:
            tp = self.config.tensor_model_parallel_size
            if hidden.shape[0] % tp or context.shape[0] % tp:
                raise ValueError(f"sequence parallelism needs image tokens ({hidden.shape[0]}) and context "
                                 f"tokens ({context.shape[0]}) divisible by tp={tp}")
            hidden = scatter_to_sequence_parallel_region(hidden)
            context = scatter_to_sequence_parallel_region(context)
        return hidden, context, temb

    def _unpack(self, packed: torch.Tensor, num_image_tokens: int):
        if self.sequence_parallel:
            num_image_tokens //= self.config.tensor_model_parallel_size
        hidden, context, temb = packed.split(
            [num_image_tokens, packed.shape[0] - num_image_tokens - 1, 1], dim=0
        )
        return hidden, context, temb[0]

    def _final(self, hidden: torch.Tensor, temb: torch.Tensor, height: int, width: int):
        scale, shift = self.final_adaln(F.silu(temb)).chunk(2, dim=-1)
        x = _modulate(F.layer_norm(hidden, hidden.shape[-1:], eps=self.config.layernorm_epsilon), shift, scale)
        out = self.final_proj(x)  # [N(/tp), B, p*p*C]
        if self.sequence_parallel:
            out = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False)
        p, c = self.config.patch_size, self.config.out_channels
        gh, gw = height // p, width // p
        out = out.view(gh, gw, out.shape[1], p, p, c).permute(2, 5, 0, 3, 1, 4)
        return out.reshape(out.shape[0], c, gh * p, gw * p)

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor,
                encoder_hidden_states: torch.Tensor, pooled_projections: torch.Tensor):
        """Velocity [B, C, H, W] on the last stage, else the packed [image; context; temb] tensor.

        Every stage receives the same batch; stages after the first use only ``latents.shape``.
        """
        height, width = latents.shape[-2:]
        num_image = (height // self.config.patch_size) * (width // self.config.patch_size)
        if self.pre_process:
            hidden, context, temb = self._embed(latents, timestep, encoder_hidden_states, pooled_projections)
        else:
            assert self.input_tensor is not None, "non-first pipeline stage needs set_input_tensor()"
            hidden, context, temb = self._unpack(self.input_tensor, num_image)
        for layer in self.layers:
            hidden, context = layer(hidden, context, temb)
        if self.post_process:
            return self._final(hidden, temb, height, width)
        return torch.cat([hidden, context, temb[None]], dim=0)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Sharded state dict with GLOBAL block indices (``layers.<global>.``), so a checkpoint
        saved at one TP/PP layout loads at another. Blocks are heterogeneous (the last one is
        context_pre_only), so each block is its own set of tensors, not one stacked tensor."""
        assert not sharded_offsets, "SD3MMDiT is the top-level module"
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
        return out
