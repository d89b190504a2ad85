"""Qwen-Image as a megatron-core model: embeddings (image, RMS-normed text, timestep) on the first stage,
double-stream blocks per stage, final adaLN + projection on the last; inputs as diffusers'
``QwenImageTransformer2DModel.forward`` (timestep = sigma, packed latents [B, N, C]).

Invariant: the output never depends on padded text tokens: every text key the mask marks as padding is
masked in every block, and text positions follow the token index. Under sequence parallelism the text is
padded (masked) up to a multiple of TP the same way. Design notes: docs/design/models.md.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from megatron.core.transformer.spec_utils import ModuleSpec

from megaflow.models.common.batch import packed_grid, stack_conditioning
from megaflow.models.common.layers import HeadRMSNorm, ReplicatedLinear
from megaflow.models.common import model as common_model
from megaflow.models.common.model import TIMESTEP_CHANNELS, DiTModel, EmbedMLP, timestep_features
from megaflow.models.qwen_image.config import ROPE_THETA, TIMESTEP_SCALE, QwenImageConfig
from megaflow.models.qwen_image.layers import qwen_rope


def as_img_shape(img_shapes) -> tuple[int, int, int]:
    """(frames, height, width) of the packed latent grid from ``img_shapes``: one triple (tuple or tensor), or
    diffusers' per-sample list ``[[(f, h, w)], ...]`` whose samples all hold the same one image; ValueError otherwise."""
    if isinstance(img_shapes, torch.Tensor):
        img_shapes = img_shapes.tolist()
    if len(img_shapes) and isinstance(img_shapes[0], (list, tuple)):  # diffusers: one list of images per sample
        images = [[sample] if len(sample) and not isinstance(sample[0], (list, tuple)) else sample
                  for sample in img_shapes]  # a sample given as one bare triple is one image
        samples = {tuple(tuple(int(v) for v in image) for image in sample) for sample in images}
        if len(samples) != 1 or len(next(iter(samples))) != 1:
            raise ValueError(f"img_shapes {img_shapes}: one (frames, height, width) image shared by the whole "
                             "batch is supported")
        img_shapes = next(iter(samples))[0]
    shape = tuple(int(v) for v in img_shapes)
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"img_shapes {shape}: expected (frames, height, width) of positive sizes")
    return shape


def padded_text_length(config: QwenImageConfig, num_text: int) -> int:
    """Text tokens the blocks see: ``num_text`` rounded up to a multiple of TP under sequence parallelism."""
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    return -(-num_text // tp) * tp


def pipeline_seq_length(config: QwenImageConfig, num_image_tokens: int, num_context_tokens: int) -> int:
    """``seq_length`` for megatron's schedule (the common rule over the text padded as the model pads it)."""
    return common_model.pipeline_seq_length(config, num_image_tokens, padded_text_length(config, num_context_tokens))


class QwenImageTransformer(DiTModel):
    """Qwen-Image's MMDiT on megatron-core, one pipeline stage / virtual chunk of it. ``layer_spec`` is one
    block's spec (``spec.get_qwen_image_layer_spec(...)``)."""

    def __init__(self, config: QwenImageConfig, layer_spec: ModuleSpec, *, pp_rank: int | None = None,
                 vp_stage: int | None = None):
        super().__init__(config, pp_rank=pp_rank, vp_stage=vp_stage)
        self._build_layers(lambda index: layer_spec)
        h = config.hidden_size
        if self.pre_process:
            self.x_embed = ReplicatedLinear(config.in_channels, h, config=config)
            self.context_norm = HeadRMSNorm(config, config.joint_attention_dim, eps=1e-6)
            self.context_embed = ReplicatedLinear(config.joint_attention_dim, h, config=config)
            self.time_embed = EmbedMLP(TIMESTEP_CHANNELS, config)
        if self.post_process:
            self._build_final()

    def _embed(self, hidden_states, timestep, encoder_hidden_states, num_context: int):
        dtype = self.config.params_dtype
        hidden = self.x_embed(hidden_states.to(dtype).transpose(0, 1))  # [N, B, h]
        text = self.context_norm(encoder_hidden_states.to(dtype))
        context = self.context_embed(F.pad(text, (0, 0, 0, num_context - text.shape[1])).transpose(0, 1))
        temb = self.time_embed(timestep_features(timestep.to(dtype), scale=TIMESTEP_SCALE).to(dtype))
        hidden, context = self._scatter(hidden, context)
        return hidden, context, temb

    @staticmethod
    def _attention_mask(mask, batch: int, num_image: int, num_text: int, num_context: int, device):
        """[B, 1, 1, N + L'] True on the keys nobody attends to (padded text), in ``[image; context]`` order;
        None when every key is attended to."""
        if mask is None and num_context == num_text:
            return None
        text = torch.ones(batch, num_text, dtype=torch.bool, device=device) if mask is None else mask.to(device).bool()
        keep = torch.cat([torch.ones(batch, num_image, dtype=torch.bool, device=device), text,
                          torch.zeros(batch, num_context - num_text, dtype=torch.bool, device=device)], dim=1)
        return ~keep[:, None, None, :]

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                img_shapes, encoder_hidden_states_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Velocity [B, N, patch_dim] on the last stage, else the packed [image; context; temb] tensor.
        ``encoder_hidden_states_mask`` [B, L]: 1 for real text tokens, 0 for padding (None: all real)."""
        shape = as_img_shape(img_shapes)
        batch, num_text = encoder_hidden_states.shape[:2]
        num_image = shape[0] * shape[1] * shape[2]
        if hidden_states.shape[1] != num_image:
            raise ValueError(f"img_shapes {shape} give {num_image} image tokens but hidden_states has "
                             f"{hidden_states.shape[1]}")
        if encoder_hidden_states_mask is not None and tuple(encoder_hidden_states_mask.shape) != (batch, num_text):
            raise ValueError(f"encoder_hidden_states_mask shape {tuple(encoder_hidden_states_mask.shape)} != "
                             f"(batch, text tokens) = {(batch, num_text)}")
        num_context = padded_text_length(self.config, num_text)
        self._check_sp_divisible(num_image, num_context)
        if self.pre_process:
            hidden, context, temb = self._embed(hidden_states, timestep, encoder_hidden_states, num_context)
        else:
            assert self.input_tensor is not None, "non-first pipeline stage needs set_input_tensor()"
            local = num_image // (self.config.tensor_model_parallel_size if self.sequence_parallel else 1)
            hidden, context, temb = self.input_tensor[:local], self.input_tensor[local:-1], self.input_tensor[-1]
        device = hidden.device
        rope = qwen_rope(shape, num_context, self.config.axes_dims_rope, ROPE_THETA, device=device)
        mask = self._attention_mask(encoder_hidden_states_mask, batch, num_image, num_text, num_context, device)
        for i, layer in enumerate(self.layers):
            hidden, context = self._run_layer(i, layer, hidden, context, temb, rope=rope, attention_mask=mask)
        if self.post_process:
            return self._final_tokens(hidden, temb).transpose(0, 1).contiguous()  # [B, N, patch_dim]
        return torch.cat([hidden, context, temb[None]], dim=0)


def batch_conditioning(config: QwenImageConfig, trajectories, cfg: bool) -> dict:
    """A trainer microbatch's conditioning keys from trajectories: the stacked Qwen2.5-VL hidden states and
    their mask (each trajectory's ``encoder_hidden_states`` padded to one length; [negative; positive] under
    CFG) and ``img_shapes`` [3] from the image size (a tensor: a microbatch holds tensors); under CFG
    ``cfg_renorm`` [B] (the sampler's true CFG rescales each token's guided velocity to the conditional one's norm:
    ``trainer.flowgrpo_batches.guided_velocity``). ValueError names what does not fit."""
    size = (trajectories[0].height, trajectories[0].width)
    if None in size or any((x.height, x.width) != size for x in trajectories):
        raise ValueError("a Qwen-Image microbatch needs one known image size (height, width) for its RoPE; got "
                         f"{sorted({(x.height, x.width) for x in trajectories}, key=str)}")
    keys = ["encoder_hidden_states"] + [f"{p}encoder_hidden_states" for p in (("negative_",) if cfg else ())]
    longest = max(x.conditioning[k].shape[0] for x in trajectories for k in keys if k in x.conditioning)
    padded = [_padded_text(x, longest) for x in trajectories]
    out = stack_conditioning(padded, ("encoder_hidden_states", "encoder_hidden_states_mask"), cfg)
    out["img_shapes"] = torch.tensor((1, *packed_grid(trajectories[0].latents.shape[-2], *size)))
    if cfg:
        out["cfg_renorm"] = torch.ones(len(trajectories), dtype=torch.bool)
    return out


def _padded_text(trajectory, length: int):
    """A copy of ``trajectory`` whose conditioning holds each text embedding [L, D] zero-padded to ``length``
    tokens, with its ``..._mask`` (1: real token; an existing mask [L] is padded with 0, else all L are real)."""
    cond = dict(trajectory.conditioning)
    for key in ("encoder_hidden_states", "negative_encoder_hidden_states"):
        if key in cond:
            text = cond[key]
            mask = cond.get(f"{key}_mask", torch.ones(text.shape[0], dtype=torch.long))
            cond[key] = F.pad(text, (0, 0, 0, length - text.shape[0]))
            cond[f"{key}_mask"] = F.pad(mask.long(), (0, length - text.shape[0]))
    return replace(trajectory, conditioning=cond)


def model_inputs(config: QwenImageConfig, microbatch: dict) -> dict:
    """``QwenImageTransformer.forward`` kwargs for a microbatch (latents [B, N, C] packed, sigma [B], text
    embeddings and their mask, img_shapes); Qwen-Image's timestep input is sigma itself."""
    return dict(hidden_states=microbatch["latents"], timestep=microbatch["sigma"],
                encoder_hidden_states=microbatch["encoder_hidden_states"], img_shapes=microbatch["img_shapes"],
                encoder_hidden_states_mask=microbatch.get("encoder_hidden_states_mask"))


def microbatch_seq_length(config: QwenImageConfig, microbatch: dict) -> int:
    """``seq_length`` for megatron's schedule for a trainer microbatch (see ``model_inputs``)."""
    return pipeline_seq_length(config, microbatch["latents"].shape[1], microbatch["encoder_hidden_states"].shape[1])
