"""Rank functions for tests/models/test_qwen_image_parallel.py: the megatron Qwen-Image model at several
TP/SP/PP layouts inside one gloo launch, compared with diffusers (velocity, loss) and with the TP=1
megatron run (grads); plus the padding check (a prompt alone == the same prompt padded in a batch).
The family-independent parts are in common_workers.py.

Module-level functions only: they are pickled by reference into the ranks. The ranks never import
diffusers (slow); the parent computes the diffusers reference and passes it in a file.
"""
from __future__ import annotations

import megaflow  # noqa: F401  (import guards before megatron)
import torch

import common_workers


def megatron_core_attention_spec(*, config, pp_rank, vp_stage):
    """Provider callable (dotted path): the local spec with megatron's own DotProductAttention (padding mask)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megaflow.models.qwen_image.spec import get_qwen_image_layer_spec

    return get_qwen_image_layer_spec("local", core_attention=DotProductAttention)


def build_engine(dcfg: dict, layout: dict, *, seed: int = 1234):
    """init_distributed for ``layout`` (ParallelDims kwargs, plus optional "spec") and a Trainer."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return common_workers.build_engine("qwen_image", dcfg, layout, seed=seed,
                                       ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))


def microbatch(b: dict) -> dict:
    """A trainer microbatch (x_t, sigma, target, text + mask, img_shapes) from one tiny.sft_batches entry."""
    s = b["sigma"].view(-1, 1, 1)
    return {"latents": (1 - s) * b["x0"] + s * b["noise"], "sigma": b["sigma"], "target": b["noise"] - b["x0"],
            **{k: b[k] for k in ("encoder_hidden_states", "encoder_hidden_states_mask", "img_shapes")}}


def _run_layout(case: dict, layout: dict) -> tuple[dict, dict]:
    """One layout: velocities (forward only), SFT loss and full grads; (report entry, full grads); on the
    last stage also the padding error: each prompt alone, unpadded, vs its row of the padded batch."""
    from megaflow.trainer.runner import rectified_flow_loss

    eng = build_engine(case["dcfg"], layout)
    eng.load_diffusers_state_dict(case["state"])
    mbs = [microbatch(b) for b in case["batches"]]
    velocities = eng.forward_backward(mbs, None, forward_only=True)
    alone = [eng.forward_backward([mb], None, forward_only=True) for mb in _unpadded(case["batches"][0])]
    results = eng.forward_backward(mbs, rectified_flow_loss)
    grads = dict(eng.iter_full_grads())
    entry = common_workers.layout_entry(velocities, results, case)
    if velocities:
        entry["padding_err"] = max(float((a[0] - velocities[0][i]).abs().max()) for i, a in enumerate(alone))
    return entry, grads


def _unpadded(b: dict) -> list[dict]:
    """One microbatch per sample of ``b``: its real text tokens only, no mask."""
    out = []
    for i, length in enumerate(b["encoder_hidden_states_mask"].sum(1).tolist()):
        one = {k: v[i:i + 1] if isinstance(v, torch.Tensor) else v for k, v in b.items()}
        one["encoder_hidden_states"] = one["encoder_hidden_states"][:, :length]
        one["encoder_hidden_states_mask"] = None
        out.append(microbatch(one))
    return out


def parity_rank(cases_path: str, layouts: list[dict]) -> dict:
    """``common_workers.parity_rank`` for Qwen-Image (errors per (case, layout), iter_full_params exact)."""
    return common_workers.parity_rank("qwen_image", cases_path, layouts, _run_layout, build_engine)
