"""SGLang's CPU layers whose fused kernel this machine's ``sgl_kernel`` lacks, run as plain torch (hooked by the
plugin in every engine worker; Wan's modulated norms need them). Invariant: a layer keeps its fused kernel wherever
``sgl_kernel`` has it; the fallback computes the layer's own formula (its ``forward_native``, without
``torch.compile``): the residual ``residual + gate * x``, then norm(.) * (1 + scale) + shift, with frame-wise 4-D
gates, scales and shifts [B, F, 1, h] over a frame-major token sequence."""
from __future__ import annotations

_LAYERNORM = "sglang.multimodal_gen.runtime.layers.layernorm."
NORM_SCALE_SHIFT_TARGET = _LAYERNORM + "_NormScaleShift.forward_cpu"
RESIDUAL_NORM_SCALE_SHIFT_TARGET = _LAYERNORM + "_ScaleResidualNormScaleShift.forward_cpu"


def has_kernel(name: str) -> bool:
    """Whether the installed ``sgl_kernel`` registers the CPU op ``name``."""
    import torch

    try:
        getattr(torch.ops.sgl_kernel, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _per_sample(factor):
    """A per-sample factor [B, h] (Qwen-Image's final norm) as [B, 1, h]; any other shape as it is."""
    return factor[:, None] if factor.dim() == 2 else factor


def _per_frame(x, factor):
    """``x`` [B, N, h] times ``factor``: [B, h], [B, 1 or N, h], or per frame [B, F, 1, h] (N = F x tokens per
    frame)."""
    factor = _per_sample(factor)
    if factor.dim() == 4:
        return (x.unflatten(1, (factor.shape[1], x.shape[1] // factor.shape[1])) * factor).flatten(1, 2)
    return x * factor


def _modulate(normalized, shift, scale):
    """normalized * (1 + scale) + shift, the scale and shift per sample, token or frame."""
    plus = normalized + _per_frame(normalized, scale)
    shift = _per_sample(shift)
    if shift.dim() == 4:
        return (plus.unflatten(1, (shift.shape[1], plus.shape[1] // shift.shape[1])) + shift).flatten(1, 2)
    return plus + shift


def norm_scale_shift_cpu(original, module, x, shift, scale):
    """Around ``_NormScaleShift.forward_cpu``: the fused op when ``sgl_kernel`` has it, else torch."""
    if has_kernel("fused_norm_scale_shift_cpu"):
        return original(module, x, shift, scale)
    return _modulate(module.norm(x), shift, scale).to(x.dtype)


def residual_norm_scale_shift_cpu(original, module, residual, x, gate, shift, scale):
    """Around ``_ScaleResidualNormScaleShift.forward_cpu``: (modulated norm, residual), the fused op when
    ``sgl_kernel`` has it, else torch (``gate`` a tensor, or the int 1 of a cross-attention)."""
    if has_kernel("fused_scale_residual_norm_scale_shift_cpu"):
        return original(module, residual, x, gate, shift, scale)
    if isinstance(gate, int):
        if gate != 1:
            raise ValueError(f"an int gate must be 1, got {gate}")
        residual_out = residual + x
    else:
        residual_out = residual + _per_frame(x, gate)
    return _modulate(module.norm(residual_out), shift, scale), residual_out
