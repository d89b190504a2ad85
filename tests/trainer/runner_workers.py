"""Rank functions for tests/trainer (module-level: pickled by reference into the ranks)."""
from __future__ import annotations

import megaflow  # noqa: F401  (import guards before megatron)
import torch

from megaflow.parallel.dims import ParallelDims
from megaflow.parallel.distributed import destroy_distributed, init_distributed


def _engine(dcfg: dict, dims: ParallelDims, optimizer: bool):
    from megaflow.models.sd3 import from_diffusers
    from megaflow.trainer.runner import Trainer, adam_config

    init_distributed(dims, seed=1234)
    cfg = from_diffusers(dcfg, tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
                         sequence_parallel=dims.sp)
    opt = adam_config(lr=1e-3, weight_decay=0.0, grad_clip=1.0, distributed=True) if optimizer else None
    return Trainer(cfg, spec="local", optimizer_config=opt)


def _load_nan_shard(case: dict, ckpt: str, dims: ParallelDims) -> str | None:
    """Save a checkpoint whose column-parallel QKV shard on rank 1 only holds a NaN, load it on every rank; the
    error each rank raised (None: it loaded)."""
    from megaflow.trainer.checkpoint import load_checkpoint, save_checkpoint
    eng = _engine(case["dcfg"], dims, optimizer=False)
    eng.load_diffusers_state_dict(case["state"])
    if torch.distributed.get_rank() == 1:
        name, param = next((n, p) for n, p in eng.chunks[0].named_parameters() if "linear_qkv.weight" in n)
        with torch.no_grad():
            param.view(-1)[0] = float("nan")
    save_checkpoint(eng.chunks, ckpt, family="sd3", diffusers_config=case["dcfg"])
    try:
        load_checkpoint(eng.chunks, ckpt)
    except ValueError as e:
        return str(e)
    return None


def train_save_resume_rank(case_path: str, ckpt: str) -> dict:
    """TP=2 (+SP): 3 Adam steps; save model+optimizer; a 4th step; resume from the checkpoint at
    TP=2 and redo step 4 (must match); load the model at PP=2 (must equal the saved weights)."""
    from megaflow.trainer.checkpoint import load_checkpoint, save_checkpoint
    from megaflow.trainer.runner import rectified_flow_microbatch

    case = torch.load(case_path, weights_only=False)
    mbs = [rectified_flow_microbatch(b["x0"], b["noise"], b["sigma"], b["encoder_hidden_states"],
                                     b["pooled_projections"]) for b in case["batches"]]
    tp2 = ParallelDims(tp=2, sp=True)
    eng = _engine(case["dcfg"], tp2, optimizer=True)
    eng.load_diffusers_state_dict(case["state"])
    fast_paths = eng.fast_paths_active
    # a never-stepped optimizer (every update of a run skipped so far) saves too, as a fresh one
    save_checkpoint(eng.chunks, ckpt + "-fresh", family="sd3", diffusers_config=case["dcfg"], optimizer=eng.optimizer)
    losses = [float(eng.train_step(mbs)["loss"]) for _ in range(3)]
    second = dict(eng.iter_full_params())
    second = {k: v.clone() for k, v in second.items()}
    saved = {k: v.clone() for k, v in eng.iter_full_params()}  # replicated ones alias live params
    save_checkpoint(eng.chunks, ckpt, family="sd3", diffusers_config=case["dcfg"], optimizer=eng.optimizer)
    step4 = float(eng.train_step(mbs)["loss"])
    after4 = {k: v.clone() for k, v in eng.iter_full_params()}

    eng = _engine(case["dcfg"], tp2, optimizer=True)
    load_checkpoint(eng.chunks, ckpt, optimizer=eng.optimizer)
    resumed4 = float(eng.train_step(mbs)["loss"])
    resumed_after4 = dict(eng.iter_full_params())

    eng = _engine(case["dcfg"], tp2, optimizer=True)
    load_checkpoint(eng.chunks, ckpt + "-fresh", optimizer=eng.optimizer)
    fresh_losses = [float(eng.train_step(mbs)["loss"]) for _ in range(3)]
    fresh_err = max(float((second[k] - v).abs().max()) for k, v in eng.iter_full_params())

    eng = _engine(case["dcfg"], ParallelDims(pp=2), optimizer=False)
    load_checkpoint(eng.chunks, ckpt)
    pp2 = dict(eng.iter_full_params())
    nan_error = _load_nan_shard(case, ckpt + "-nan", tp2)
    destroy_distributed()
    return {"nan_error": nan_error,
        "losses": losses, "fresh_losses": fresh_losses, "fresh_param_err": fresh_err, "step4": step4, "resumed4": resumed4, "fast_paths": fast_paths,
        "resume_param_err": max(float((after4[k] - resumed_after4[k]).abs().max()) for k in after4),
        "pp2_mismatch": sorted(k for k in saved if not torch.equal(saved[k], pp2.get(k, torch.empty(0)))),
        "moved": max(float((after4[k] - saved[k]).abs().max()) for k in saved),
    }
