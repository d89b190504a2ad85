"""SD3 MMDiT as a megatron-core model, inputs as diffusers' ``SD3Transformer2DModel.forward``
(timestep = sigma * num_train_timesteps); velocity [B, C, H, W] on the last stage.

Design notes: docs/design/models.md.
"""
from __future__ import annotations

import torch
from megatron.core.transformer.spec_utils import ModuleSpec

from megaflow.models.common.batch import stack_conditioning
from megaflow.models.common.layers import ReplicatedLinear
from megaflow.models.common.model import (  # noqa: F401  (pipeline_seq_length: part of the family API)
    TIMESTEP_CHANNELS,
    DiTModel,
    EmbedMLP,
    pipeline_seq_length,
    timestep_features,
)
from megaflow.models.sd3.config import MMDiTConfig


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

    def _apply(self, fn, recurse: bool = True):
        """Casts move the position table but keep it float32, as diffusers and the engine hold it."""
        table = self.pos_embed
        super()._apply(fn, recurse)
        self.pos_embed = table.to(self.pos_embed.device)
        return self

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        gh, gw = latents.shape[-2] // self.patch_size, latents.shape[-1] // self.patch_size
        if gh > self.max_size or gw > self.max_size:
            raise ValueError(f"latent grid {gh}x{gw} exceeds pos_embed_max_size={self.max_size}")
        top, left = (self.max_size - gh) // 2, (self.max_size - gw) // 2
        pos = self.pos_embed.view(self.max_size, self.max_size, -1)[top:top + gh, left:left + gw]
        x = self.proj(latents).flatten(2).permute(2, 0, 1)  # [N, B, h]
        return (x + pos.reshape(gh * gw, 1, -1)).to(x.dtype)


class SD3MMDiT(DiTModel):
    """The SD3 / SD3.5 MMDiT on megatron-core (one pipeline stage / virtual chunk of it)."""

    def __init__(self, config: MMDiTConfig, layer_spec: ModuleSpec, *, pp_rank: int | None = None,
                 vp_stage: int | None = None):
        super().__init__(config, pp_rank=pp_rank, vp_stage=vp_stage)
        self._build_layers(lambda index: layer_spec)
        if self.pre_process:
            self.patch_embed = PatchEmbed(config)
            self.time_embed = EmbedMLP(TIMESTEP_CHANNELS, config)
            self.text_embed = EmbedMLP(config.pooled_projection_dim, config)
            self.context_embed = ReplicatedLinear(config.joint_attention_dim, config.hidden_size, config=config)
        if self.post_process:
            self._build_final()

    def _embed(self, latents, timestep, encoder_hidden_states, pooled_projections):
        dtype = self.config.params_dtype  # inputs in model precision; the timestep stays as given
        latents, encoder_hidden_states = latents.to(dtype), encoder_hidden_states.to(dtype)
        pooled_projections = pooled_projections.to(dtype)
        hidden = self.patch_embed(latents)
        context = self.context_embed(encoder_hidden_states.transpose(0, 1))  # [L, B, h]
        temb = self.time_embed(timestep_features(timestep).to(pooled_projections.dtype))
        temb = temb + self.text_embed(pooled_projections)
        self._check_sp_divisible(hidden.shape[0], context.shape[0])
        hidden, context = self._scatter(hidden, context)
        return hidden, context, temb

    def _unpack(self, packed: torch.Tensor, num_image_tokens: int):
        if self.sequence_parallel:
            num_image_tokens //= self.config.tensor_model_parallel_size
        hidden, context, temb = packed.split(
            [num_image_tokens, packed.shape[0] - num_image_tokens - 1, 1], dim=0
        )
        return hidden, context, temb[0]

    def _final(self, hidden: torch.Tensor, temb: torch.Tensor, height: int, width: int):
        out = self._final_tokens(hidden, temb)  # [N, B, p*p*C]
        p, c = self.config.patch_size, self.config.out_channels
        gh, gw = height // p, width // p
        out = out.view(gh, gw, out.shape[1], p, p, c).permute(2, 5, 0, 3, 1, 4)
        return out.reshape(out.shape[0], c, gh * p, gw * p)

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor,
                encoder_hidden_states: torch.Tensor, pooled_projections: torch.Tensor):
        """Velocity [B, C, H, W] on the last stage, else the packed [image; context; temb] tensor."""
        height, width = latents.shape[-2:]
        num_image = (height // self.config.patch_size) * (width // self.config.patch_size)
        if self.pre_process:
            hidden, context, temb = self._embed(latents, timestep, encoder_hidden_states, pooled_projections)
        else:
            assert self.input_tensor is not None, "non-first pipeline stage needs set_input_tensor()"
            hidden, context, temb = self._unpack(self.input_tensor, num_image)
        for i, layer in enumerate(self.layers):
            hidden, context = self._run_layer(i, layer, hidden, context, temb)
        if self.post_process:
            return self._final(hidden, temb, height, width)
        return torch.cat([hidden, context, temb[None]], dim=0)


def batch_conditioning(config: MMDiTConfig, trajectories, cfg: bool) -> dict:
    """The conditioning keys of a trainer microbatch (see ``model_inputs``) from rollout trajectories:
    encoder_hidden_states and pooled_projections stacked, [negative; positive] under CFG."""
    return stack_conditioning(trajectories, ("encoder_hidden_states", "pooled_projections"), cfg)


def model_inputs(config: MMDiTConfig, microbatch: dict) -> dict:
    """``SD3MMDiT.forward`` kwargs for a microbatch (latents [B, C, H, W], sigma [B], embeddings)."""
    return dict(latents=microbatch["latents"], timestep=microbatch["sigma"] * float(config.num_train_timesteps),
                encoder_hidden_states=microbatch["encoder_hidden_states"],
                pooled_projections=microbatch["pooled_projections"])


def microbatch_seq_length(config: MMDiTConfig, microbatch: dict) -> int:
    """``seq_length`` for megatron's schedule for a trainer microbatch (see ``model_inputs``)."""
    p = config.patch_size
    num_image = (microbatch["latents"].shape[-2] // p) * (microbatch["latents"].shape[-1] // p)
    return pipeline_seq_length(config, num_image, microbatch["encoder_hidden_states"].shape[1])
