"""Wan (text-to-video) as a megatron-core model, inputs as diffusers' ``WanTransformer3DModel.forward``:
latents [B, C, F, H, W] (the frame axis throughout), timestep = sigma * 1000 [B], UMT5 hidden states; the
velocity [B, C, F, H, W] on the last stage. Between pipeline stages: [video; text; temb; 6 time-projection rows].

Design notes: docs/design/models.md.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.spec_utils import ModuleSpec

from megaflow.models.common import model as common_model
from megaflow.models.common.batch import stack_conditioning
from megaflow.models.common.config import gelu_tanh
from megaflow.models.common.layers import ReplicatedLinear
from megaflow.models.common.model import DiTModel, EmbedMLP, timestep_features
from megaflow.models.common.rope import Rope, rope_table
from megaflow.models.wan.config import NUM_TRAIN_TIMESTEPS, ROPE_THETA, WanConfig
from megaflow.models.wan.layers import norm_modulate, scale_shift_table

MODULATION_ROWS = 6  # per block: shift, scale, gate of the self-attention, then of the MLP


def latent_grid(config: WanConfig, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(frames, rows, columns) of tokens for latents of ``shape`` [B, C, F, H, W]; ValueError for a shape
    that is not 5-D, not divisible by the patch or past the rotary tables."""
    if len(shape) != 5:
        raise ValueError(f"Wan latents must be [B, C, F, H, W] (a frame axis even for one frame), got {tuple(shape)}")
    for size, p, axis in zip(shape[2:], config.patch_size, ("frames", "height", "width")):
        if size % p:
            raise ValueError(f"latent {axis} {size} is not divisible by patch size {p} (patch_size={config.patch_size})")
    grid = tuple(size // p for size, p in zip(shape[2:], config.patch_size))
    if max(grid) > config.rope_max_seq_len:
        raise ValueError(f"latent grid {grid} (frames, rows, columns after patching) exceeds "
                         f"rope_max_seq_len={config.rope_max_seq_len}")
    return grid


def grid_ids(grid: tuple[int, int, int], device=None) -> torch.Tensor:
    """Position ids [f*h*w, 3] = (frame, row, column) in token order (frames outermost, as the Conv3d flattens)."""
    axes = [torch.arange(n, device=device) for n in grid]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)


class FinalLayer(torch.nn.Module):
    """diffusers' output ``scale_shift_table`` [1, 2, h] (shift, scale added to temb) and ``proj_out``."""

    def __init__(self, config: WanConfig):
        super().__init__()
        self.scale_shift_table = scale_shift_table(config, 2)
        self.proj = ReplicatedLinear(config.hidden_size, config.patch_dim, config=config, sequence_parallel_grad=True)


class WanTransformer(DiTModel):
    """Wan 2.1 / 2.2 text-to-video transformer on megatron-core (one pipeline stage / virtual chunk of it)."""

    def __init__(self, config: WanConfig, layer_spec: ModuleSpec, *, pp_rank: int | None = None,
                 vp_stage: int | None = None):
        super().__init__(config, pp_rank=pp_rank, vp_stage=vp_stage)
        self._build_layers(lambda index: layer_spec)
        h = config.hidden_size
        if self.pre_process:
            device = None if config.use_cpu_initialization else torch.cuda.current_device()
            self.patch_embed = torch.nn.Conv3d(config.in_channels, h, kernel_size=config.patch_size,
                                               stride=config.patch_size, device=device, dtype=config.params_dtype)
            self.time_embed = EmbedMLP(config.freq_dim, config)
            self.time_proj = ReplicatedLinear(h, MODULATION_ROWS * h, config=config, sequence_parallel_grad=True)
            self.text_embed = EmbedMLP(config.text_dim, config, activation=gelu_tanh, sequence_parallel_grad=False)
        if self.post_process:
            self.final = FinalLayer(config)

    def _embed(self, latents, timestep, encoder_hidden_states):
        """(video [N(/tp), B, h], text [L(/tp), B, h], temb [B, h], time projection [B, 6, h])."""
        if timestep.ndim != 1:
            raise ValueError(f"timestep must be [B] (one per sample), got shape {tuple(timestep.shape)}")
        dtype = self.config.params_dtype
        hidden = self.patch_embed(latents.to(dtype)).flatten(2).permute(2, 0, 1)  # [N, B, h]
        temb = self.time_embed(timestep_features(timestep, self.config.freq_dim).to(dtype))
        time_proj = self.time_proj(F.silu(temb)).unflatten(1, (MODULATION_ROWS, -1))
        context = self.text_embed(encoder_hidden_states.to(dtype).transpose(0, 1))  # [L, B, h]
        hidden, context = self._scatter(hidden, context)
        return hidden, context, temb, time_proj

    def _unpack(self, packed: torch.Tensor, num_video: int):
        if self.sequence_parallel:
            num_video //= self.config.tensor_model_parallel_size
        rows = 1 + MODULATION_ROWS
        hidden, context, cond = packed.split([num_video, packed.shape[0] - num_video - rows, rows], dim=0)
        return hidden, context, cond[0], cond[1:].transpose(0, 1)

    def _final(self, hidden: torch.Tensor, temb: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        shift, scale = (self.final.scale_shift_table + temb[:, None]).unbind(1)
        out = self.final.proj(norm_modulate(hidden, shift, scale, self.config.layernorm_epsilon))  # [N(/tp), B, D]
        if self.sequence_parallel:
            out = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False)
        (f, h, w), (pt, ph, pw), c = grid, self.config.patch_size, self.config.out_channels
        out = out.view(f, h, w, out.shape[1], pt, ph, pw, c).permute(3, 7, 0, 4, 1, 5, 2, 6)
        return out.reshape(out.shape[0], c, f * pt, h * ph, w * pw)

    def _rope(self, grid: tuple[int, int, int], device) -> Rope:
        return rope_table(grid_ids(grid, device), self.config.rope_axes, ROPE_THETA)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor,
                encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        """Velocity [B, C, F, H, W] on the last stage, else the packed [video; text; temb; time projection]."""
        grid = latent_grid(self.config, tuple(hidden_states.shape))
        num_video = math.prod(grid)
        self._check_sp_divisible(num_video, encoder_hidden_states.shape[1])
        if self.pre_process:
            hidden, context, temb, time_proj = self._embed(hidden_states, timestep, encoder_hidden_states)
        else:
            assert self.input_tensor is not None, "non-first pipeline stage needs set_input_tensor()"
            hidden, context, temb, time_proj = self._unpack(self.input_tensor, num_video)
        rope = self._rope(grid, hidden.device)
        for i, layer in enumerate(self.layers):
            hidden = self._run_layer(i, layer, hidden, context, time_proj, rope=rope)
        if self.post_process:
            return self._final(hidden, temb, grid)
        return torch.cat([hidden, context, temb[None], time_proj.transpose(0, 1)], dim=0)


def pipeline_seq_length(config: WanConfig, num_video_tokens: int, num_context_tokens: int) -> int:
    """``seq_length`` for megatron's schedule: video + text tokens + temb + the 6 time-projection rows."""
    return common_model.pipeline_seq_length(config, num_video_tokens, num_context_tokens, rows=1 + MODULATION_ROWS)


def batch_conditioning(config: WanConfig, trajectories, cfg: bool) -> dict:
    """The conditioning keys of a trainer microbatch (see ``model_inputs``) from rollout trajectories: the
    text's encoder_hidden_states stacked, [negative; positive] under CFG."""
    return stack_conditioning(trajectories, ("encoder_hidden_states",), cfg)


def model_inputs(config: WanConfig, microbatch: dict) -> dict:
    """``WanTransformer.forward`` kwargs for a microbatch (latents [B, C, F, H, W], sigma [B], text states)."""
    return dict(hidden_states=microbatch["latents"], timestep=microbatch["sigma"] * float(NUM_TRAIN_TIMESTEPS),
                encoder_hidden_states=microbatch["encoder_hidden_states"])


def microbatch_seq_length(config: WanConfig, microbatch: dict) -> int:
    """``seq_length`` for megatron's schedule for a trainer microbatch (see ``model_inputs``)."""
    grid = latent_grid(config, tuple(microbatch["latents"].shape))
    return pipeline_seq_length(config, math.prod(grid), microbatch["encoder_hidden_states"].shape[1])
