"""Rank functions for tests/models/test_flux_parallel.py: the megatron FLUX model at several
TP/SP/PP/VPP layouts inside one gloo launch, compared with diffusers (velocity, loss) and with the
TP=1 megatron run (grads).

Module-level functions only: they are pickled by reference into the ranks. The ranks never import
diffusers (slow); the parent computes the diffusers reference and passes it in a file.

``FluxTrainEngine`` is TrainEngine with the family-specific part of ``forward_backward`` taken
from the family (``model_inputs`` / ``microbatch_seq_length``): the change TrainEngine needs to
train FLUX (see megaflow.models.flux.model).
"""
from __future__ import annotations

from functools import partial

import megaflow  # noqa: F401  (import guards before megatron)
import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from megaflow.models.flux.model import microbatch_seq_length, model_inputs
from megaflow.parallel import ParallelDims, destroy_distributed, init_distributed
from megaflow.trainer.engine import TrainEngine, _megatron_loss


class FluxTrainEngine(TrainEngine):
    """TrainEngine whose forward step builds the model inputs with ``flux.model.model_inputs``."""

    def forward_backward(self, microbatches, loss_fn, *, forward_only=False):
        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            out = model(**model_inputs(self.config, mb))
            return out, (partial(_megatron_loss, loss_fn, mb) if loss_fn is not None else None)

        if not forward_only:
            for m in self.model:
                m.zero_grad_buffer()
        iterators = [iter(microbatches) for _ in self.model]
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=self.model, num_microbatches=len(microbatches),
            seq_length=microbatch_seq_length(self.config, microbatches[0]),
            micro_batch_size=microbatches[0]["latents"].shape[0], forward_only=forward_only,
        )


def megatron_core_attention_spec(*, config, pp_rank, vp_stage):
    """Provider callable (dotted path): the local spec with megatron's own DotProductAttention."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megaflow.models.flux.spec import get_flux_layer_spec

    return get_flux_layer_spec("local", core_attention=DotProductAttention)


def build_engine(dcfg: dict, layout: dict, *, seed: int = 1234) -> FluxTrainEngine:
    """init_distributed for ``layout`` (ParallelDims kwargs, plus optional "spec") and an engine."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from megaflow.models.flux import from_diffusers

    layout = dict(layout)
    spec = layout.pop("spec", "local")
    dims = ParallelDims(**layout)
    init_distributed(dims, seed=seed)
    cfg = from_diffusers(dcfg, tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
                         virtual_pipeline_model_parallel_size=dims.vpp, sequence_parallel=dims.sp)
    return FluxTrainEngine(cfg, family="flux", spec=spec,
                           ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))


def microbatches(batches: list[dict]) -> list[dict]:
    """Trainer microbatches (x_t, sigma, target, conditioning, ids, guidance) from tiny.sft_batches."""
    from megaflow.trainer.engine import rectified_flow_microbatch

    out = []
    for b in batches:
        mb = rectified_flow_microbatch(b["x0"], b["noise"], b["sigma"], b["encoder_hidden_states"],
                                       b["pooled_projections"])
        mb.update({k: b[k] for k in ("txt_ids", "img_ids", "guidance") if k in b})
        out.append(mb)
    return out


def _max_abs(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:3]
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _run_layout(case: dict, layout: dict) -> tuple[dict, dict]:
    """One layout: velocities (forward only), SFT loss and full grads; (report entry, full grads)."""
    from megatron.core import parallel_state as ps

    from megaflow.trainer.engine import rectified_flow_loss

    eng = build_engine(case["dcfg"], layout)
    eng.load_diffusers_state_dict(case["state"])
    mbs = microbatches(case["batches"])
    velocities = eng.forward_backward(mbs, None, forward_only=True)
    results = eng.forward_backward(mbs, rectified_flow_loss)
    grads = dict(eng.iter_full_grads())
    entry = {"last_stage": ps.is_pipeline_last_stage(ignore_virtual=True)}
    if velocities:
        entry["out_err"] = max(float((v - r).abs().max()) for v, r in zip(velocities, case["ref_velocities"]))
        loss = float(sum(r["loss"] for r in results) / len(results))
        entry["loss_err"] = abs(loss - case["ref_loss"])
    return entry, grads


def parity_rank(cases_path: str, layouts: list[dict]) -> dict:
    """For each case: TP=1 first (reference grads), then every layout; errors per (case, layout).

    ``cases_path``: a torch.save'd list of cases (tensors as args would be passed as fds, too many
    for multiprocessing). Also checks that ``iter_full_params`` at the last layout returns exactly
    the loaded weights (full tensors do not depend on the layout)."""
    from megaflow.models.flux import from_diffusers, weight_map

    cases = torch.load(cases_path, weights_only=False)
    report = {}
    for case in cases:
        ref_entry, ref_grads = _run_layout(case, {})
        ref_entry["grad_err_vs_diffusers"] = _max_abs(ref_grads, case["ref_grads"])
        report[(case["name"], "tp1")] = ref_entry
        for layout in layouts:
            entry, grads = _run_layout(case, layout)
            entry["grad_err"] = _max_abs(grads, ref_grads)
            entry["grad_scale"] = max(float(g.abs().max()) for g in ref_grads.values())
            report[(case["name"], str(layout))] = entry
        eng = build_engine(case["dcfg"], layouts[-1])
        eng.load_diffusers_state_dict(case["state"])
        expected = weight_map.to_megatron_full(case["state"], from_diffusers(case["dcfg"]))
        got = dict(eng.iter_full_params())
        report[(case["name"], "iter_full_params_exact")] = got.keys() == expected.keys() and all(
            torch.equal(got[k], expected[k]) for k in expected)
    destroy_distributed()
    return report
