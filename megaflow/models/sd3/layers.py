"""The SD3 MMDiT block on megatron-core (layout [s, b, h]). Design notes: docs/design/models.md."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from megaflow.models.common.layers import AdaLNBlockSubmodules, gated_residual, layer_norm, modulate
from megaflow.models.sd3.config import MMDiTConfig

MMDiTLayerSubmodules = AdaLNBlockSubmodules  # the SD3 name of the shared submodule table


class MMDiTLayer(MegatronModule):
    """One SD3 JointTransformerBlock; layer ``num_layers`` (1-based) is context_pre_only: its context
    stream only feeds keys/values and is not returned."""

    def __init__(self, config: MMDiTConfig, submodules: AdaLNBlockSubmodules, layer_number: int):
        super().__init__(config=config)
        self.layer_number = layer_number  # 1-based, global (megatron convention)
        self.context_pre_only = layer_number == config.num_layers
        self.dual = (layer_number - 1) in config.dual_attention_layers
        h = config.hidden_size

        def adaln(n: int):
            return build_module(submodules.adaln, h, n * h, config=config, sequence_parallel_grad=True)

        self.adaln = adaln(9 if self.dual else 6)
        self.context_adaln = adaln(2 if self.context_pre_only else 6)
        self.attention = build_module(submodules.attention, config=config, layer_number=layer_number,
                                      context_output=not self.context_pre_only)
        if self.dual:
            self.attention2 = build_module(submodules.attention, config=config,
                                           layer_number=layer_number, has_context=False)
        self.mlp = build_module(submodules.mlp, config=config, ffn_hidden_size=config.ffn_hidden_size)
        if not self.context_pre_only:
            self.context_mlp = build_module(submodules.mlp, config=config,
                                            ffn_hidden_size=config.ffn_hidden_size)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.config.layernorm_epsilon)

    def forward(self, hidden: torch.Tensor, context: torch.Tensor, temb: torch.Tensor):
        """hidden [n, b, h], context [l, b, h], temb [b, h] -> (hidden, context or None)."""
        emb = F.silu(temb)
        mod = self.adaln(emb).chunk(9 if self.dual else 6, dim=-1)
        cmod = self.context_adaln(emb).chunk(2 if self.context_pre_only else 6, dim=-1)
        normed = self._norm(hidden)
        x = modulate(normed, mod[0], mod[1])
        cnormed = self._norm(context)
        if self.context_pre_only:
            c = modulate(cnormed, cmod[1], cmod[0])  # AdaLayerNormContinuous: (scale, shift)
        else:
            c = modulate(cnormed, cmod[0], cmod[1])
        image_attn, context_attn = self.attention(x, c)
        hidden = gated_residual(hidden, mod[2], image_attn)
        if self.dual:
            image_attn2, _ = self.attention2(modulate(normed, mod[6], mod[7]))
            hidden = gated_residual(hidden, mod[8], image_attn2)
        x = modulate(self._norm(hidden), mod[3], mod[4])
        hidden = gated_residual(hidden, mod[5], self.mlp(x))
        if self.context_pre_only:
            return hidden, None
        context = gated_residual(context, cmod[2], context_attn)
        c = modulate(self._norm(context), cmod[3], cmod[4])
        context = gated_residual(context, cmod[5], self.context_mlp(c))
        return hidden, context
