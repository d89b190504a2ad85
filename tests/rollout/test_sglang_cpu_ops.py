"""megaflow.rollout.sglang.cpu_ops: the torch fallbacks of SGLang's fused CPU norm-scale-shift layers equal the
layers' formula written out independently here (per sample [B, h] or [B, 1, h], per token [B, N, h], per frame
[B, F, 1, h] over frame-major tokens; gate 1 for a cross-attention), exactly in fp32; the fused op is called when
sgl_kernel has it.
Needs: CPU, 1 process, no engine (~1 s)."""
from __future__ import annotations

import types

import pytest
import torch

from megaflow.rollout.sglang import cpu_ops

B, F, T, H = 2, 3, 4, 8  # batch, frames, tokens per frame, hidden


def _module():
    return types.SimpleNamespace(norm=torch.nn.LayerNorm(H, elementwise_affine=False, eps=1e-6))


def _per_frame(t: torch.Tensor) -> torch.Tensor:
    """[B, F, 1, h] -> [B, F * T, h]: each frame's row repeated over its tokens (the reference's broadcast)."""
    return t.expand(B, F, T, H).reshape(B, F * T, H)


@pytest.mark.parametrize("shape", [(B, H), (B, 1, H), (B, F * T, H), (B, F, 1, H)])  # [B, h]: Qwen-Image's norm_out
def test_norm_scale_shift_is_the_layers_formula(monkeypatch, shape):
    monkeypatch.setattr(cpu_ops, "has_kernel", lambda name: False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, F * T, H, generator=g)
    scale, shift = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    module = _module()
    wide = {4: _per_frame, 3: lambda t: t, 2: lambda t: t.unsqueeze(1)}[len(shape)]
    want = module.norm(x) * (1 + wide(scale)) + wide(shift)
    got = cpu_ops.norm_scale_shift_cpu(None, module, x, shift, scale)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("gate_shape", [None, (B, 1, H), (B, F, 1, H)])
def test_residual_norm_scale_shift_is_the_layers_formula(monkeypatch, gate_shape):
    monkeypatch.setattr(cpu_ops, "has_kernel", lambda name: False)
    g = torch.Generator().manual_seed(1)
    residual, x = torch.randn(B, F * T, H, generator=g), torch.randn(B, F * T, H, generator=g)
    scale, shift = torch.randn(B, 1, H, generator=g), torch.randn(B, 1, H, generator=g)
    gate = 1 if gate_shape is None else torch.randn(gate_shape, generator=g)
    module = _module()
    wide_gate = 1 if gate_shape is None else (_per_frame(gate) if len(gate_shape) == 4 else gate)
    want_residual = residual + x * wide_gate
    got, got_residual = cpu_ops.residual_norm_scale_shift_cpu(None, module, residual, x, gate, shift, scale)
    torch.testing.assert_close(got_residual, want_residual, rtol=0, atol=1e-6)
    torch.testing.assert_close(got, module.norm(want_residual) * (1 + scale) + shift, rtol=0, atol=1e-6)


def test_the_fused_op_runs_where_sgl_kernel_has_it(monkeypatch):
    monkeypatch.setattr(cpu_ops, "has_kernel", lambda name: True)
    calls = []
    out = cpu_ops.norm_scale_shift_cpu(lambda *a: calls.append(a) or "fused", _module(), "x", "shift", "scale")
    assert out == "fused" and len(calls) == 1
