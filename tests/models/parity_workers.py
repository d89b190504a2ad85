"""Rank side of every family's parity test (test_parallel_parity.py, test_sd3_model.py, test_wan_model.py): the
family's megatron model at several TP/SP/PP/VPP layouts inside one gloo launch, compared with diffusers (velocity,
loss) and with the TP=1 megatron run (grads); one launch may hold cases of several families. A family differs only
in how a tiny.sft_batches entry becomes a trainer microbatch (MICROBATCH) and, for SD3, in the velocity call.

Module-level functions only: they are pickled by reference into the ranks, and the spec providers are named by
dotted path ("parity_workers:sd3_core_attention_spec"). The ranks never import diffusers (slow); the parent
(parity_cases.py) computes the diffusers reference and passes it in a file.
"""
from __future__ import annotations

import megaflow  # noqa: F401  (import guards before megatron)
import torch

from megaflow.parallel.dims import ParallelDims
from megaflow.parallel.distributed import destroy_distributed, init_distributed


def _with_core_attention(get_spec):
    """The family's local spec with megatron's own DotProductAttention."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return get_spec("local", core_attention=DotProductAttention)


def sd3_core_attention_spec(*, config, pp_rank, vp_stage):
    from megaflow.models.sd3.spec import get_mmdit_layer_spec

    return _with_core_attention(get_mmdit_layer_spec)


def flux_core_attention_spec(*, config, pp_rank, vp_stage):
    from megaflow.models.flux.spec import get_flux_layer_spec

    return _with_core_attention(get_flux_layer_spec)


def qwen_image_core_attention_spec(*, config, pp_rank, vp_stage):
    """With the padding mask."""
    from megaflow.models.qwen_image.spec import get_qwen_image_layer_spec

    return _with_core_attention(get_qwen_image_layer_spec)


def wan_core_attention_spec(*, config, pp_rank, vp_stage):
    """In both attentions."""
    from megaflow.models.wan.spec import get_wan_layer_spec

    return _with_core_attention(get_wan_layer_spec)


def sd3_whole_model_provider(*, config, pp_rank, vp_stage):
    """Provider callable (dotted path) that returns a whole model chunk instead of a spec."""
    from megaflow.models.sd3 import SD3MMDiT, get_mmdit_layer_spec

    return SD3MMDiT(config, get_mmdit_layer_spec("local"), pp_rank=pp_rank, vp_stage=vp_stage)


def build_engine(family: str, dcfg: dict, layout: dict, *, seed: int = 1234):
    """init_distributed for ``layout`` (ParallelDims kwargs, plus optional "spec", default "local") and a Trainer
    of ``family`` for diffusers config ``dcfg`` (grads reduced in fp32)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from megaflow.models.registry import get_family
    from megaflow.trainer.runner import Trainer

    layout = dict(layout)
    spec = layout.pop("spec", "local")
    dims = ParallelDims(**layout)
    init_distributed(dims, seed=seed)
    cfg = get_family(family).config_from_diffusers(
        dcfg, tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp, sequence_parallel=dims.sp,
    )
    return Trainer(cfg, family=family, spec=spec,
                   ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))


def _rectified_flow(b: dict, *, pooled: bool = True, keys: tuple[str, ...] = ()) -> dict:
    """x_t, sigma, target and text states (``pooled``: with pooled projections; ``keys``: copied as they are)."""
    from megaflow.trainer.runner import rectified_flow_microbatch

    mb = rectified_flow_microbatch(b["x0"], b["noise"], b["sigma"], b["encoder_hidden_states"],
                                   b["pooled_projections"] if pooled else None)
    if not pooled:
        del mb["pooled_projections"]  # Wan and Qwen-Image have no pooled text embedding
    mb.update({k: b[k] for k in keys if k in b})
    return mb


MICROBATCH = {
    "sd3": _rectified_flow,
    "flux": lambda b: _rectified_flow(b, keys=("txt_ids", "img_ids", "guidance")),
    "qwen_image": lambda b: _rectified_flow(b, pooled=False, keys=("encoder_hidden_states_mask", "img_shapes")),
    "wan": lambda b: _rectified_flow(b, pooled=False),
}


def _unpadded(b: dict) -> list[dict]:
    """Qwen-Image: one microbatch per sample of ``b``, its real text tokens only, no mask."""
    out = []
    for i, length in enumerate(b["encoder_hidden_states_mask"].sum(1).tolist()):
        one = {k: v[i:i + 1] if isinstance(v, torch.Tensor) else v for k, v in b.items()}
        one["encoder_hidden_states"] = one["encoder_hidden_states"][:, :length]
        one["encoder_hidden_states_mask"] = None
        out.append(MICROBATCH["qwen_image"](one))
    return out


def run_layout(case: dict, layout: dict) -> tuple[dict, dict]:
    """One layout: velocities, SFT loss and full grads; (report entry, full grads). SD3 takes its velocity on
    microbatch 0 through ``Trainer.velocity``, the others through a forward-only pass; Qwen-Image also reports the
    padding error on the last stage (each prompt alone, unpadded, vs its row of the padded batch)."""
    from megatron.core import parallel_state as ps

    from megaflow.trainer.runner import rectified_flow_loss

    family = case["family"]
    eng = build_engine(family, case["dcfg"], layout)
    eng.load_diffusers_state_dict(case["state"])
    mbs = [MICROBATCH[family](b) for b in case["batches"]]
    if family == "sd3":
        v = eng.velocity(mbs[0]["latents"], mbs[0]["sigma"], mbs[0]["encoder_hidden_states"],
                         mbs[0]["pooled_projections"])
        velocities = [] if v is None else [v]
    else:
        velocities = eng.forward_backward(mbs, None, forward_only=True)
    alone = ([eng.forward_backward([mb], None, forward_only=True) for mb in _unpadded(case["batches"][0])]
             if family == "qwen_image" else [])
    results = eng.forward_backward(mbs, rectified_flow_loss)
    grads = dict(eng.iter_full_grads())
    entry = {"last_stage": ps.is_pipeline_last_stage(ignore_virtual=True)}
    if velocities:
        entry["out_err"] = max(float((v - r).abs().max()) for v, r in zip(velocities, case["ref_velocities"]))
        entry["loss_err"] = abs(float(sum(r["loss"] for r in results) / len(results)) - case["ref_loss"])
        if alone:
            entry["padding_err"] = max(float((a[0] - velocities[0][i]).abs().max()) for i, a in enumerate(alone))
    return entry, grads


def max_abs(a: dict, b: dict) -> float:
    """Largest absolute difference between two dicts of tensors with the same keys."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:3]
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def parity_rank(cases_path: str) -> dict:
    """For each case: TP=1 first (reference grads), then each of its ``layouts``; errors per (case, layout).

    ``cases_path``: a torch.save'd list of cases (tensors as args would be passed as fds, too many for
    multiprocessing). Also checks that ``iter_full_params`` at the case's last layout returns exactly the loaded
    weights (full tensors do not depend on the layout)."""
    from megaflow.models.registry import get_family

    report = {}
    for case in torch.load(cases_path, weights_only=False):
        fam = get_family(case["family"])
        ref_entry, ref_grads = run_layout(case, {})
        ref_entry["grad_err_vs_diffusers"] = max_abs(ref_grads, case["ref_grads"])
        report[(case["name"], "tp1")] = ref_entry
        for layout in case["layouts"]:
            entry, grads = run_layout(case, layout)
            entry["grad_err"] = max_abs(grads, ref_grads)
            report[(case["name"], str(layout))] = entry
        eng = build_engine(case["family"], case["dcfg"], case["layouts"][-1])
        eng.load_diffusers_state_dict(case["state"])
        expected = fam.weight_map.to_megatron_full(case["state"], fam.config_from_diffusers(case["dcfg"]))
        got = dict(eng.iter_full_params())
        report[(case["name"], "iter_full_params_exact")] = got.keys() == expected.keys() and all(
            torch.equal(got[k], expected[k]) for k in expected)
    destroy_distributed()
    return report
