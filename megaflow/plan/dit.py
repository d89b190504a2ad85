"""What ``megaflow plan`` counts with: DiT dimensions, parameter counts (``sharded`` by TP / ``replicated``),
activation sizes; from a config.json or ``BUILTIN``. Standard library only. Design notes: docs/design/plan.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from megaflow.families import card, family_names

# The families' published transformer configs (``megaflow.families``' cards): name -> (source, config dict).
BUILTIN = {name: card(name).builtin for name in family_names()}

# Saved activations per token per hidden unit of one block, in activation-dtype units: (replicated, TP-split).
STREAM = (8.0, 14.0)       # one MMDiT stream: LN in, modulated, residual operands, MLP in | qkv, q/k norm, attn, 4h x 2
DUAL_EXTRA = (2.0, 6.0)    # SD3.5 second image attention: modulated input, residual | qkv, q/k norm, out
QK_NORM_EXTRA = (0.0, 6.0)  # q/k RMSNorm of a stream: normed q and k, their fp32 statistics
CONTEXT_PRE_ONLY = (2.0, 5.0)  # SD3's last block: context only normed, modulated and projected to q/k/v
SINGLE = (3.0, 17.0)       # FLUX single block on the joint sequence: LN, modulated, residual | qkv+mlp, GELU, q/k, cat
# A cross-attention block (Wan): the video tokens' stream as STREAM without its MLP, plus the cross-attention's
# LN in and out | q, its norm, the attention output; the MLP is 2 x ffn / hidden TP-split units (fc1 out, GELU out).
# The text tokens: cross-attention k, v and the normed k, TP-split (the text states themselves are shared by blocks).
CROSS_STREAM = (10.0, 6.0 + QK_NORM_EXTRA[1] + 3.0)
CROSS_TEXT = (0.0, 3.0)
# Under LoRA (base frozen) autograd keeps no input of a frozen linear (torch's F.linear and Transformer Engine's
# linears save the input only for the weight's grad) and no operand that only an adaLN modulation's grad needs
# (shift/scale/gate come from the frozen adaLN): a stream keeps its norm inputs, q/k/v, the attention output and
# the GELU input, plus the input of every targeted linear (its adapter's A reads it). Fitted to autograd's saved
# bytes of the tiny SD3.5-like and FLUX models with adapters on linear_qkv (tests/plan/test_plan.py); each further
# target adds its linear's input, as measured: linear_proj the attention output (1, TP-split), linear_fc1 the
# modulated input (1, replicated), linear_fc2 the 4h GELU output (4, TP-split).
LORA_STREAM = (3.0, 5.5)   # one stream with adapters on linear_qkv (its modulated input is the replicated 1)
LORA_TARGET_INPUT = {"linear_qkv": (1.0, 0.0), "linear_proj": (0.0, 1.0), "linear_fc1": (1.0, 0.0),
                     "linear_fc2": (0.0, 4.0)}
LORA_SINGLE = (2.0, 10.0)  # FLUX single block under LoRA (measured the same for every target set)
LORA_STAGE_EXTRA = 1.0     # embeddings and final layer frozen: only the loss operands remain
BLOCK_INPUTS = 1.0         # with recompute a block keeps only its inputs (the token streams)
STAGE_EXTRA = 4.0          # embeddings, final layer and loss operands per token, once per stage
INFERENCE_LIVE = 12.0      # engine forward: live tensors of one block (streams, q/k/v, attention, 4h MLP x 2)
VAE_DECODE_PER_PIXEL = 512.0  # VAE decoder at full resolution: ~4 live 128-channel maps per output pixel


@dataclass(frozen=True)
class DiTDims:
    """The numbers of a DiT the plan needs (see ``dims_from_config``)."""

    family: str
    source: str
    hidden: int
    heads: int
    head_dim: int
    blocks: int            # joint (two-stream) blocks: SD3 MMDiT blocks / FLUX double-stream blocks
    single_blocks: int     # single-stream blocks after them (FLUX; 0 for SD3)
    dual_blocks: int       # leading blocks with a second image attention (SD3.5; 0 for FLUX)
    qk_norm: bool
    in_channels: int
    out_channels: int
    patch: int
    joint_dim: int
    pooled_dim: int
    guidance_embeds: bool
    pos_table: int = 0     # SD3: rows of the fp32 sin-cos position table (pos_embed_max_size ** 2), a buffer
    context_pre_only_last: bool = False  # SD3: the last joint block's text stream stops at q/k/v
    cross_attention: bool = False  # Wan: every block one stream of video tokens (self-attention, cross-attention
    # to the text, MLP) modulated by a table of its own and one shared time projection; False: MMDiT joint blocks
    ffn: int = 0           # the MLP's hidden width (0: 4 x hidden)
    freq_dim: int = 256    # the timestep's sinusoid channels (cross-attention blocks)
    cross_norm: bool = True  # a LayerNorm with weights before the cross-attention (cross-attention blocks)

    @property
    def num_blocks(self) -> int:
        return self.blocks + self.single_blocks

    @property
    def mlp(self) -> int:
        return self.ffn or 4 * self.hidden


def dims_from_config(family: str, conf: dict, source: str) -> DiTDims:
    """``DiTDims`` from a diffusers transformer config dict (defaults as the diffusers classes have them; the
    family-specific fields from its card's ``plan_dims``)."""
    heads, head_dim = int(conf["num_attention_heads"]), int(conf["attention_head_dim"])
    own = card(family).plan_dims(conf)  # it may set out_channels / joint_dim where its class's defaults differ
    shared = dict(out_channels=int(conf.get("out_channels") or own["in_channels"]),
                  joint_dim=int(conf.get("joint_attention_dim", 4096)),
                  guidance_embeds=bool(conf.get("guidance_embeds", False)))
    return DiTDims(family=family, source=source, hidden=heads * head_dim, heads=heads, head_dim=head_dim,
                   **{**shared, **own})


def _linear(i: int, o: int) -> int:
    return i * o + o


def block_params(d: DiTDims, index: int) -> tuple[int, int]:
    """(TP-sharded, replicated) parameters of block ``index`` (SD3 block, FLUX double, then FLUX single)."""
    h, norms = d.hidden, (2 * d.head_dim if d.qk_norm else 0)
    mlp = _linear(h, d.mlp) + _linear(d.mlp, h)
    if d.cross_attention:  # self-attention q k v o, cross-attention q k v o, their q/k norms over every head (split by
        # heads under TP) | the modulation table (6 x h), the cross-attention's LayerNorm
        return 8 * _linear(h, h) + mlp + (4 * h if d.qk_norm else 0), 6 * h + (2 * h if d.cross_norm else 0)
    if index >= d.blocks:  # single-stream: qkv + mlp-in, fused out over [attn; mlp]
        return 3 * _linear(h, h) + _linear(h, 4 * h) + _linear(5 * h, h), _linear(h, 3 * h) + norms
    last = d.context_pre_only_last and index == d.blocks - 1  # no context output / MLP
    sharded = 4 * _linear(h, h) + mlp + 3 * _linear(h, h) + (0 if last else _linear(h, h) + mlp)
    dual = index < d.dual_blocks
    replicated = _linear(h, (9 if dual else 6) * h) + _linear(h, 2 * h if last else 6 * h) + 2 * norms
    if dual:
        sharded += 4 * _linear(h, h)
        replicated += norms
    return sharded, replicated


def lora_params(d: DiTDims, index: int, rank: int, targets) -> int:
    """LoRA adapter parameters (A: r x in, B: out x r) of block ``index`` for the targeted linears of each stream:
    linear_qkv (q, k, v: one adapter each, as PEFT), linear_proj, linear_fc1 (h -> 4h), linear_fc2 (4h -> h). A FLUX
    single-stream block has one stream whose fused output projection reads [attn; mlp] (5h -> h). SD3.5's second
    attention (dual blocks) is not counted: the adapters are a few percent of the weights either way."""
    h = d.hidden
    per = {"linear_qkv": 3 * 2 * h, "linear_proj": 2 * h, "linear_fc1": h + d.mlp, "linear_fc2": d.mlp + h}
    if d.cross_attention:  # linear_qkv: the self-attention's q, k, v; linear_proj: both attentions' outputs
        return rank * sum({**per, "linear_proj": 2 * per["linear_proj"]}[t] for t in targets)
    if index >= d.blocks:
        per = {"linear_qkv": 3 * 2 * h, "linear_proj": 6 * h, "linear_fc1": 5 * h, "linear_fc2": 0}
        return rank * sum(per[t] for t in targets)
    image = sum(per[t] for t in targets)
    last = d.context_pre_only_last and index == d.blocks - 1  # the text stream has q/k/v only
    text = per["linear_qkv"] if last and "linear_qkv" in targets else (0 if last else image)
    return rank * (image + text)


def embed_params(d: DiTDims) -> int:
    """Embeddings (first pipeline stage): patch/x embedding, context embedding, timestep (+ guidance) and
    pooled-text MLPs."""
    h = d.hidden
    x = d.in_channels * d.patch * d.patch * h + h
    if d.cross_attention:  # time MLP, the shared time projection to the blocks' 6 modulations, text MLP
        time = _linear(d.freq_dim, h) + _linear(h, h) + _linear(h, 6 * h)
        return x + time + _linear(d.joint_dim, h) + _linear(h, h)
    mlps = (_linear(256, h) + _linear(h, h)) * (2 if d.guidance_embeds else 1) + _linear(d.pooled_dim, h) + _linear(h, h)
    return x + _linear(d.joint_dim, h) + mlps


def final_params(d: DiTDims) -> int:
    """Final adaLN (a table under cross-attention blocks) and projection (last pipeline stage)."""
    adaln = 2 * d.hidden if d.cross_attention else _linear(d.hidden, 2 * d.hidden)
    return adaln + _linear(d.hidden, d.patch * d.patch * d.out_channels)


def buffer_bytes(d: DiTDims) -> int:
    """Non-parameter tensors of the first stage: SD3's position table, fp32 in trainer and engine alike."""
    return d.pos_table * d.hidden * 4


def total_params(d: DiTDims) -> int:
    """Every parameter of the DiT."""
    return embed_params(d) + final_params(d) + sum(sum(block_params(d, i)) for i in range(d.num_blocks))


def lora_stream(targets) -> tuple[float, float]:
    """(replicated, TP-split) saved units of one stream when only LoRA adapters on ``targets`` train."""
    rep, split = LORA_STREAM
    rep -= 0.0 if "linear_qkv" in targets else LORA_TARGET_INPUT["linear_qkv"][0]
    for t in ("linear_proj", "linear_fc1", "linear_fc2"):
        if t in targets:
            rep, split = rep + LORA_TARGET_INPUT[t][0], split + LORA_TARGET_INPUT[t][1]
    return rep, split


def block_activation_units(d: DiTDims, index: int, image: int, text: int, tp: int, sp: bool,
                           lora_targets=None) -> float:
    """Saved activations of block ``index`` in training per sample, in (activation dtype x hidden) units.
    ``lora_targets``: the base is frozen and only adapters on these linears train (``LORA_STREAM``); None:
    every weight trains."""
    def part(coef, tokens):
        rep, split = coef
        return tokens * (rep / (tp if sp else 1) + split / tp)
    if index >= d.blocks:
        return part(SINGLE if lora_targets is None else LORA_SINGLE, image + text)
    if d.cross_attention:  # under LoRA too (an upper bound: the frozen linears' inputs counted)
        rep, split = CROSS_STREAM
        return part((rep, split + 2 * d.mlp / d.hidden), image) + part(CROSS_TEXT, text)
    last = d.context_pre_only_last and index == d.blocks - 1
    stream = STREAM if lora_targets is None else lora_stream(lora_targets)
    units = part(stream, image) + part(CONTEXT_PRE_ONLY if last else stream, text)
    if d.qk_norm:
        units += part(QK_NORM_EXTRA, image + text)
    if index < d.dual_blocks:
        units += part(DUAL_EXTRA, image)
    return units
