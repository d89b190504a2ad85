"""Rank functions for tests/parallel: a tiny bidirectional megatron-core TransformerBlock (a DiT-like
stack: attention with AttnMaskType.no_mask, local spec, fp32) run at TP=1, TP=2, TP=2+SP and PP=2
inside one gloo launch, every layout compared with the TP=1 reference built from the same weights.

Module-level functions only: they are pickled by reference into the ranks.
"""
from __future__ import annotations

import megaflow  # noqa: F401  (import guards before megatron)
import torch

from megaflow.parallel.dims import ParallelDims
from megaflow.parallel.distributed import destroy_distributed, init_distributed
from megaflow.parallel.sp_norm import SPTorchNorm

SEQ, BATCH, HIDDEN, HEADS, LAYERS, MICROBATCHES = 8, 2, 32, 4, 2, 2


def make_config(dims: ParallelDims, num_layers: int = LAYERS, recompute: bool = False):
    from megatron.core.transformer import TransformerConfig

    recompute_kwargs = (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if recompute else {}
    )
    return TransformerConfig(
        **recompute_kwargs,
        num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
        tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
        sequence_parallel=dims.sp, pipeline_dtype=torch.float32, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
    )


def make_block(config, *, seed: int = 7):
    """TransformerBlock with bidirectional self-attention and SP-capable torch norms (this PP stage)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_block import (
        TransformerBlock, TransformerBlockSubmodules, get_num_layers_to_build,
    )

    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.no_mask
    spec.submodules.input_layernorm = SPTorchNorm
    spec.submodules.pre_mlp_layernorm = SPTorchNorm
    submodules = TransformerBlockSubmodules(
        layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=SPTorchNorm
    )
    torch.manual_seed(seed)
    block = TransformerBlock(
        config, submodules,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
    )
    return _StageModel(block)


class _StageModel(torch.nn.Module):
    """What a pipeline stage needs around a TransformerBlock: model_type, config, pre/post_process
    and share_embeddings_and_output_weights (read by finalize_model_grads), and a
    set_input_tensor that unwraps the schedule's one-element list (as GPTModel does)."""

    def __init__(self, block):
        from megatron.core.enums import ModelType

        super().__init__()
        self.decoder = block
        self.config = block.config
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process, self.post_process = block.pre_process, block.post_process
        self.share_embeddings_and_output_weights = False

    def set_input_tensor(self, input_tensor):
        if isinstance(input_tensor, list):
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def forward(self, hidden_states, attention_mask=None):
        return self.decoder(hidden_states, attention_mask=attention_mask)


def make_data(seed: int = 11):
    """Microbatch inputs [s, b, h] and a fixed projection for the loss, equal on every rank."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(SEQ, BATCH, HIDDEN, generator=g) for _ in range(MICROBATCHES)]
    w = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    return xs, w


def global_name(model, local_name: str) -> str:
    """'decoder.layers.<local>.x' -> 'decoder.layers.<global>.x' via each layer's layer_number."""
    if not local_name.startswith("decoder.layers."):
        return local_name
    _, _, idx, rest = local_name.split(".", 3)
    return f"decoder.layers.{model.decoder.layers[int(idx)].layer_number - 1}.{rest}"


def shard_of(full: torch.Tensor, param, dims: ParallelDims) -> torch.Tensor:
    """This TP rank's slice of a full tensor, following megatron's partition_dim."""
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False):
        return full
    return full.chunk(dims.tp, dim=param.partition_dim)[ps.get_tensor_model_parallel_rank()]


def run_train_step(block, config, dims: ParallelDims):
    """DDP-wrap the block, run forward_backward_func (1F1B at PP>1) over the microbatches, finalize
    grads. Returns (losses of this rank's last stage, outputs [s_local,b,h] per microbatch, ddp)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), block)
    config.finalize_model_grads_func = finalize_model_grads
    xs, w = make_data()
    seq_local = SEQ // dims.tp if dims.sp else SEQ
    start = ps.get_tensor_model_parallel_rank() * seq_local if dims.sp else 0

    def forward_step(data_iterator, model):
        # requires_grad as if produced by an embedding: megatron's activation checkpoint passes no
        # grads to a layer whose input does not require grad
        x = next(data_iterator)[start:start + seq_local].clone().requires_grad_(True)
        out = model(x, attention_mask=None)

        def loss_func(output):
            loss = (output * w[start:start + seq_local]).sum()
            return loss, {"loss": loss.detach().clone(), "out": output.detach().clone()}

        return out, loss_func

    ddp.zero_grad_buffer()
    results = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(xs), model=[ddp],
        num_microbatches=MICROBATCHES, seq_length=seq_local, micro_batch_size=BATCH,
        forward_only=False,
    )
    return [r["loss"] for r in results], [r["out"] for r in results], ddp


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def layout_id(layout: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in layout.items())


def equivalence_rank(layouts: list[dict]) -> dict:
    """Run the TP=1 reference then each layout (ParallelDims kwargs, plus ``recompute`` and
    ``untag_sp_norms`` for a negative control). Returns this rank's
    {layout_id: {grad_rel_err, out_rel_err, loss_rel_err, numel}} (out/loss only on the last
    pipeline stage); errors are the max over parameters / microbatches."""
    from megatron.core import parallel_state as ps

    init_distributed(ParallelDims(), seed=1234)
    cfg = make_config(ParallelDims())
    ref_block = make_block(cfg)
    ref_losses, ref_outs, ref_ddp = run_train_step(ref_block, cfg, ParallelDims())
    ref_params = {n: p.detach().clone() for n, p in ref_block.named_parameters()}
    ref_grads = {n: p.main_grad.detach().clone() for n, p in ref_block.named_parameters()}
    del ref_ddp

    report = {"reference": {"numel": sum(p.numel() for p in ref_block.parameters())}}
    for layout in layouts:
        kwargs = dict(layout)
        untag = kwargs.pop("untag_sp_norms", False)  # negative control: SP norm grads not reduced
        recompute = kwargs.pop("recompute", False)  # full activation recompute (RNG tracker states)
        dims = ParallelDims(**kwargs)
        init_distributed(dims, seed=1234)
        cfg = make_config(dims, recompute=recompute)
        block = make_block(cfg, seed=99)  # different init on purpose: weights come from ref
        for p in block.parameters() if untag else ():
            if getattr(p, "sequence_parallel", False):
                p.sequence_parallel = False
        with torch.no_grad():
            for name, p in block.named_parameters():
                p.copy_(shard_of(ref_params[global_name(block, name)], p, dims))
        losses, outs, _ = run_train_step(block, cfg, dims)
        grad_err = max(
            rel_err(p.main_grad, shard_of(ref_grads[global_name(block, name)], p, dims))
            for name, p in block.named_parameters()
        )
        entry = {"grad_rel_err": grad_err, "numel": sum(p.numel() for p in block.parameters())}
        if ps.is_pipeline_last_stage():
            seq_local = SEQ // dims.tp if dims.sp else SEQ
            start = ps.get_tensor_model_parallel_rank() * seq_local if dims.sp else 0
            entry["out_rel_err"] = max(
                rel_err(o, r[start:start + seq_local]) for o, r in zip(outs, ref_outs)
            )
            loss = torch.stack(losses)
            if dims.sp:  # each rank's loss covers its sequence slice: sum them
                torch.distributed.all_reduce(loss, group=ps.get_tensor_model_parallel_group())
            entry["loss_rel_err"] = rel_err(loss, torch.stack(ref_losses))
        report[layout_id(layout)] = entry
    destroy_distributed()
    return report

