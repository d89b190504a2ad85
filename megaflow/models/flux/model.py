"""FLUX.1 as a megatron-core model: embeddings on the first stage, double- then single-stream
blocks per stage, final adaLN + projection on the last. Design notes: docs/design/models.md.
"""
from __future__ import annotations

import torch
from megatron.core.transformer.spec_utils import ModuleSpec

from megaflow.models.common.batch import packed_grid, stack_conditioning
from megaflow.models.common.layers import ReplicatedLinear
from megaflow.models.common.model import TIMESTEP_CHANNELS, DiTModel, EmbedMLP, pipeline_seq_length, timestep_features
from megaflow.models.flux.config import ROPE_THETA, TIMESTEP_SCALE, FluxConfig
from megaflow.models.flux.layers import FluxRope, rope_table


def image_ids(height: int, width: int) -> torch.Tensor:
    """img_ids [height*width, 3] = (0, row, col) for a grid of packed latent tokens (FluxPipeline's
    convention; its txt_ids are zeros [L, 3])."""
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()


def sp_joint_order(num_context: int, num_image: int, tp: int) -> torch.Tensor:
    """Token permutation of the all-gathered local ``[context_r; image_r]`` shards:
    ``[ctx_0; img_0; ctx_1; img_1; ...]`` as indices into the natural ``[context; image]`` order."""
    lr, nr = num_context // tp, num_image // tp
    return torch.cat([torch.cat([torch.arange(r * lr, (r + 1) * lr), num_context + torch.arange(r * nr, (r + 1) * nr)])
                      for r in range(tp)])


class FluxTransformer(DiTModel):
    """FLUX.1 (dev: with guidance embedding; schnell: without) on megatron-core, one pipeline
    stage / virtual chunk of it. ``layer_spec`` is ``spec.get_flux_layer_spec(...)``."""

    def __init__(self, config: FluxConfig, layer_spec: ModuleSpec, *, pp_rank: int | None = None,
                 vp_stage: int | None = None):
        super().__init__(config, pp_rank=pp_rank, vp_stage=vp_stage)
        blocks = getattr(layer_spec, "submodules", None)
        if not (hasattr(blocks, "double") and hasattr(blocks, "single")):
            raise ValueError("a FLUX layer spec must be a ModuleSpec whose submodules have .double and .single "
                             "(see megaflow.models.flux.spec.get_flux_layer_spec)")
        self._build_layers(lambda index: blocks.single if config.is_single(index) else blocks.double)
        h = config.hidden_size
        if self.pre_process:
            self.x_embed = ReplicatedLinear(config.in_channels, h, config=config)
            self.context_embed = ReplicatedLinear(config.joint_attention_dim, h, config=config)
            self.time_embed = EmbedMLP(TIMESTEP_CHANNELS, config)
            if config.guidance_embeds:
                self.guidance_embed = EmbedMLP(TIMESTEP_CHANNELS, config)
            self.text_embed = EmbedMLP(config.pooled_projection_dim, config)
        if self.post_process:
            self._build_final()

    def _conditioning(self, timestep, guidance, pooled_projections):
        """temb [B, h] = time (+ guidance) embedding + pooled-text embedding (diffusers' order)."""
        dtype = self.config.params_dtype
        temb = self.time_embed(timestep_features(timestep.to(dtype) * TIMESTEP_SCALE).to(pooled_projections.dtype))
        if self.config.guidance_embeds:
            g = timestep_features(guidance.to(dtype) * TIMESTEP_SCALE).to(pooled_projections.dtype)
            temb = temb + self.guidance_embed(g)
        return temb + self.text_embed(pooled_projections)

    def _embed(self, hidden_states, timestep, encoder_hidden_states, pooled_projections, guidance):
        dtype = self.config.params_dtype
        hidden = self.x_embed(hidden_states.to(dtype).transpose(0, 1))  # [N, B, h]
        context = self.context_embed(encoder_hidden_states.to(dtype).transpose(0, 1))  # [L, B, h]
        temb = self._conditioning(timestep, guidance, pooled_projections.to(dtype))
        hidden, context = self._scatter(hidden, context)
        return context, hidden, temb

    def _rope(self, txt_ids: torch.Tensor, img_ids: torch.Tensor) -> FluxRope:
        cos, sin = rope_table(torch.cat([txt_ids, img_ids]), self.config.axes_dims_rope, ROPE_THETA)
        num_context = txt_ids.shape[0]
        joint = (cos, sin)
        if self.sequence_parallel:
            order = sp_joint_order(num_context, img_ids.shape[0], self.config.tensor_model_parallel_size)
            joint = (cos[order.to(cos.device)], sin[order.to(cos.device)])
        return FluxRope(image=(cos[num_context:], sin[num_context:]),
                        context=(cos[:num_context], sin[:num_context]), joint=joint)

    def _final(self, hidden: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        return self._final_tokens(hidden, temb).transpose(0, 1).contiguous()  # [B, N, patch_dim]

    def _check_inputs(self, num_image: int, num_context: int, guidance) -> None:
        if self.pre_process and self.config.guidance_embeds != (guidance is not None):
            raise ValueError(f"guidance={'None' if guidance is None else 'given'} but config.guidance_embeds="
                             f"{self.config.guidance_embeds}")
        self._check_sp_divisible(num_image, num_context)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor, txt_ids: torch.Tensor, img_ids: torch.Tensor,
                guidance: torch.Tensor | None = None) -> torch.Tensor:
        """Velocity [B, N, patch_dim] on the last stage, else the packed [context; image; temb] tensor."""
        txt_ids = txt_ids[0] if txt_ids.ndim == 3 else txt_ids
        img_ids = img_ids[0] if img_ids.ndim == 3 else img_ids
        num_context, num_image = txt_ids.shape[0], img_ids.shape[0]
        if self.pre_process and (hidden_states.shape[1], encoder_hidden_states.shape[1]) != (num_image, num_context):
            raise ValueError(f"img_ids/txt_ids have {num_image}/{num_context} rows but hidden_states/"
                             f"encoder_hidden_states have {hidden_states.shape[1]}/{encoder_hidden_states.shape[1]} tokens")
        self._check_inputs(num_image, num_context, guidance)
        if self.pre_process:
            context, hidden, temb = self._embed(hidden_states, timestep, encoder_hidden_states,
                                                pooled_projections, guidance)
        else:
            assert self.input_tensor is not None, "non-first pipeline stage needs set_input_tensor()"
            packed = self.input_tensor
            lr = num_context // (self.config.tensor_model_parallel_size if self.sequence_parallel else 1)
            context, hidden, temb = packed[:lr], packed[lr:-1], packed[-1]
        rope = self._rope(txt_ids, img_ids)
        joint = None
        for i, layer in enumerate(self.layers):
            if layer.single:
                joint = torch.cat([context, hidden]) if joint is None else joint
                joint = self._run_layer(i, layer, joint, temb, rope=rope.joint)
            else:
                hidden, context = self._run_layer(i, layer, hidden, context, temb, rope=rope)
        if joint is not None:
            context, hidden = joint[:context.shape[0]], joint[context.shape[0]:]
        if self.post_process:
            return self._final(hidden, temb)
        return torch.cat([context, hidden, temb[None]], dim=0)


def batch_conditioning(config: FluxConfig, trajectories, cfg: bool) -> dict:
    """A trainer microbatch's conditioning keys from trajectories: stacked embeddings, FluxPipeline's
    txt_ids / img_ids, guidance [B] when the model embeds it. ``cfg`` raises ValueError (no true CFG)."""
    if cfg:
        raise ValueError("FLUX.1 has no classifier-free guidance branch: its guidance_scale is the embedded "
                         "guidance (trajectories must have do_cfg=False)")
    size = (trajectories[0].height, trajectories[0].width)
    if None in size or any((x.height, x.width) != size for x in trajectories):
        raise ValueError("a FLUX microbatch needs one known image size (height, width) for its img_ids; got "
                         f"{sorted({(x.height, x.width) for x in trajectories}, key=str)}")
    out = stack_conditioning(trajectories, ("encoder_hidden_states", "pooled_projections"), cfg=False)
    num_tokens = trajectories[0].latents.shape[-2]
    out["txt_ids"] = torch.zeros(out["encoder_hidden_states"].shape[1], 3)
    out["img_ids"] = image_ids(*packed_grid(num_tokens, *size))
    if config.guidance_embeds:
        out["guidance"] = torch.tensor([float(x.guidance_scale) for x in trajectories])
    return out


def model_inputs(config: FluxConfig, microbatch: dict) -> dict:
    """``FluxTransformer.forward`` kwargs for a microbatch (latents [B, N, C] packed, sigma [B],
    embeddings, txt_ids, img_ids, guidance); FLUX's timestep input is sigma itself."""
    return dict(hidden_states=microbatch["latents"], timestep=microbatch["sigma"],
                encoder_hidden_states=microbatch["encoder_hidden_states"],
                pooled_projections=microbatch["pooled_projections"], txt_ids=microbatch["txt_ids"],
                img_ids=microbatch["img_ids"], guidance=microbatch.get("guidance"))


def microbatch_seq_length(config: FluxConfig, microbatch: dict) -> int:
    """``seq_length`` for megatron's schedule for a trainer microbatch (see ``model_inputs``)."""
    return pipeline_seq_length(config, microbatch["latents"].shape[1], microbatch["encoder_hidden_states"].shape[1])
