"""Rank functions for tests/parallel/test_cpu_shims.py: for every CPU shim, the smallest megatron-core
operation that needs it. ``shim_checks_rank`` runs each check once with only that shim removed
(expecting megatron's failure) and once with all shims applied (expecting success).
"""
from __future__ import annotations

import tempfile
import traceback

import megaflow  # noqa: F401  (import guards before megatron)
import torch

from megaflow.parallel import cpu
from megaflow.parallel.dims import ParallelDims
from megaflow.parallel.distributed import destroy_distributed, init_distributed


def _config(**overrides):
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _linear(config):
    from megatron.core import tensor_parallel

    torch.manual_seed(0)
    return tensor_parallel.ColumnParallelLinear(
        16, 16, config=config, init_method=torch.nn.init.xavier_uniform_, bias=True, gather_output=True
    )


class _Tiny(torch.nn.Module):
    """A column-parallel linear with the attributes megatron's schedules/DDP look up."""

    def __init__(self, config):
        from megatron.core.enums import ModelType

        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.linear = _linear(config)

    def set_input_tensor(self, _):
        pass

    def forward(self, x):
        return self.linear(x)[0]


def _ddp(use_distributed_optimizer=False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    cfg = _config()
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer)
    return DistributedDataParallel(cfg, ddp_cfg, _Tiny(cfg))


def _backward(model):
    model.zero_grad_buffer()
    model(torch.randn(4, 16)).square().sum().backward()
    model.finish_grad_sync()


def _optimizer(model, **kwargs):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    return get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, **kwargs), [model])


def check_rng_tracker():
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(321)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        a = torch.rand(3)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        b = torch.rand(3)
    assert not torch.equal(a, b), "tracker state did not advance"


def check_allocation_device():
    _linear(_config(use_cpu_initialization=False))(torch.randn(4, 16))


def check_pipeline_device():
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = _Tiny(_config())

    def step(data, m):
        out = m(next(data))
        return out, lambda o: (o.sum(), {})

    get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter([torch.randn(4, 16)]), model=[model],
        num_microbatches=1, seq_length=4, micro_batch_size=1,
    )


def check_ddp_grad_buffer():
    _backward(_ddp())


def check_optimizer_device():
    model = _ddp()
    opt = _optimizer(model, clip_grad=0.0)
    _backward(model)
    assert opt.step()[0]


def check_clip_grads_type():
    model = _ddp()
    opt = _optimizer(model, clip_grad=1e-3)
    _backward(model)
    ok, grad_norm, _ = opt.step()
    assert ok and grad_norm > 1e-3


def check_optimizer_type_names():
    model = _ddp(use_distributed_optimizer=True)
    opt = _optimizer(model, use_distributed_optimizer=True)
    _backward(model)
    assert opt.step()[0]


def check_dist_ckpt_device():
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    weight = torch.arange(6.0).reshape(2, 3)
    with tempfile.TemporaryDirectory() as tmp:
        dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", weight, replica_id=0)}, tmp)
        template = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(2, 3))}
        loaded = dist_checkpointing.load(template, tmp)
    assert torch.equal(loaded["w"], weight)


CHECKS = {
    name[len("check_"):]: fn for name, fn in globals().items() if name.startswith("check_")
}


def _outcome(fn) -> dict | None:
    """None on success, else the error and the innermost megatron.core file it was raised in."""
    try:
        fn()
        return None
    except Exception as e:  # noqa: BLE001 - reported to the test
        frames = [f.filename for f in traceback.extract_tb(e.__traceback__)]
        in_mcore = [f.split("megatron/core/", 1)[1] for f in frames if "megatron/core/" in f]
        lines = str(e).strip().splitlines() or [""]
        where = in_mcore[-1] if in_mcore else None
        return {"error": f"{type(e).__name__}: {lines[0][:300]}", "where": where}


def shim_checks_rank(names: list[str]) -> dict:
    """For each shim: error with only it removed ('off'), error with all applied ('on', None = ok)."""
    init_distributed(ParallelDims(), seed=5)
    report = {}
    for name in names:
        cpu.apply_cpu_shims()
        cpu.remove_cpu_shims({name})
        off = _outcome(CHECKS[name])
        cpu.apply_cpu_shims()
        on = _outcome(CHECKS[name])
        report[name] = {"off": off, "on": on}
    # Undo/redo leaves megatron's own code in place when everything is removed.
    cpu.remove_cpu_shims()
    from megatron.core.tensor_parallel import layers

    report["_restored"] = layers.torch is torch and not cpu.applied_cpu_shims()
    cpu.apply_cpu_shims()
    destroy_distributed()
    return report
