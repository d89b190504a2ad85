"""Rank functions for tests/trainer/test_reference.py: the KL reference built the old way (a Trainer
without optimizer, DDP-wrapped, grads switched off afterwards) and as a ReferenceModel, same weights,
compared output for output and byte for byte of what each holds.

Module-level functions only: they are pickled by reference into the ranks.
"""
from __future__ import annotations

import megaflow  # noqa: F401  (import guards before megatron)
import torch

from megaflow.parallel.dims import ParallelDims
from megaflow.parallel.distributed import destroy_distributed, init_distributed


def _policy(cfg, state):
    from megaflow.trainer.runner import Trainer

    policy = Trainer(cfg, family="sd3", spec="local", optimizer_config=None)
    policy.load_diffusers_state_dict(state)
    return policy


def _old_reference(cfg, state):
    ref = _policy(cfg, state)
    for m in ref.model:
        m.requires_grad_(False)
    return ref


def _new_reference(cfg, state):
    from megaflow.trainer.runner import ReferenceModel

    ref = ReferenceModel(cfg, family="sd3", spec="local")
    ref.load_diffusers_state_dict(state)
    return ref


def _velocity_loss(velocity: torch.Tensor, mb: dict):
    """A training pass's loss that hands back the velocity it saw."""
    return velocity.float().pow(2).mean(), {"velocity": velocity.detach().clone()}


def compare_rank(case_path: str, layouts: list[dict]) -> dict:
    """Per layout (ParallelDims kwargs + optional "bf16"): whether the velocities of both references are
    bitwise equal (last stage; None elsewhere), their byte counts (megaflow.testing.memory.model_bytes), and
    whether every parameter of the new one is frozen and the old path's velocities are non-trivial; and a
    trainable policy's forward-only velocities: equal to those of its training pass (forward + backward), and
    recorded without autograd. (The frozen references' differ from a trainable model's by ~1e-7: megatron's linear
    layers take another path for frozen weights.)"""
    from megaflow.models.sd3 import from_diffusers
    from megaflow.testing.memory import model_bytes
    from megaflow.trainer.runner import rectified_flow_microbatch

    case = torch.load(case_path, weights_only=False)
    mbs = [rectified_flow_microbatch(b["x0"], b["noise"], b["sigma"], b["encoder_hidden_states"],
                                     b["pooled_projections"]) for b in case["batches"]]
    report = {}
    for layout in layouts:
        layout = dict(layout)
        bf16 = layout.pop("bf16", False)
        dims = ParallelDims(**layout)
        init_distributed(dims, seed=1234)
        extra = dict(bf16=True, params_dtype=torch.bfloat16) if bf16 else {}
        cfg = from_diffusers(case["dcfg"], tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
                             sequence_parallel=dims.sp, **extra)
        old, new = _old_reference(cfg, case["state"]), _new_reference(cfg, case["state"])
        v_old = old.forward_backward(mbs, None, forward_only=True)
        v_new = new.forward_backward(mbs, None, forward_only=True)
        policy = _policy(cfg, case["state"])
        v_policy = policy.forward_backward(mbs, None, forward_only=True)
        v_policy_trained = [m["velocity"] for m in policy.forward_backward(mbs, _velocity_loss)]
        report[str({**layout, "bf16": bf16})] = dict(
            equal=None if not v_old else all(torch.equal(a, b) for a, b in zip(v_old, v_new)) and len(v_old) == len(v_new),
            scale=max((float(v.abs().max()) for v in v_old), default=None),
            old_bytes=model_bytes(old.model), new_bytes=model_bytes(new.model),
            frozen=not any(p.requires_grad for c in new.chunks for p in c.parameters()),
            wrapped=[type(m).__name__ for m in new.model],
            policy_equal=None if not v_old else (len(v_policy) == len(v_policy_trained) and all(
                torch.equal(a, b) for a, b in zip(v_policy, v_policy_trained))),
            policy_graph=any(v.requires_grad or v.grad_fn is not None for v in v_policy))
        try:
            new.forward_backward(mbs, None)
            report["refuses_backward"] = False
        except ValueError:
            report["refuses_backward"] = True
    destroy_distributed()
    return report
