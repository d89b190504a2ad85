"""Save and restore everything an RL run needs to continue exactly (collective over trainer ranks).

A checkpoint holds the model, optimizer and shadows as a dist checkpoint, and ``state.json`` (iteration, prompt
position, RNG states, metrics, config). Invariant: everything else is a pure function of ``run.seed`` and the
iteration, so resuming from k and running to n gives the uninterrupted run's weights bit for bit.
"""
from __future__ import annotations

import base64
import json
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megaflow.checksum import DEFAULT
from megaflow.parallel.distributed import barrier, rank
from megaflow.rundir import faults
from megaflow.rundir.checkpoints import (CHECKPOINTS, MODEL_DIR, REMOVING, STATE_FILE, checkpoint_dir, list_checkpoints,
                                        read_state, remove_checkpoint)
from megaflow.trainer.manifest import verify_manifest, write_manifest


def rng_state() -> dict:
    """This process's RNG states as JSON-able values."""
    np_state = np.random.get_state()
    return {"python": repr(random.getstate()),
            "numpy": [np_state[0], base64.b64encode(np_state[1].tobytes()).decode(), *np_state[2:]],
            "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}


def set_rng_state(state: dict) -> None:
    import ast
    random.setstate(ast.literal_eval(state["python"]))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.frombuffer(base64.b64decode(keys), dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))


def save(trainer, run_dir: Path, iteration: int, *, family: str, diffusers_config: dict, prompts_consumed: int,
         metrics_rows: list[dict], keep: int, shadows: dict | None = None, checksum: str = DEFAULT,
         write_extra: Callable[[Path], None] | None = None, algorithm: str | None = None) -> float:
    """Collective: write ``checkpoints/iter_<iteration>`` atomically (manifests last) and keep the newest ``keep``;
    ``shadows`` go beside the model, ``write_extra(directory)`` (rank 0) adds other files; ``algorithm`` (its
    ``algo.name``) is recorded for the resume's check. Returns the seconds."""
    from megaflow.trainer.checkpoint import save_checkpoint

    t0 = time.perf_counter()
    root = Path(run_dir).absolute() / CHECKPOINTS
    stage = root / f".staging-{iteration:06d}"
    if rank() == 0:
        for stale in [*root.glob(".staging-*"), *root.glob(f"{REMOVING}*")] if root.is_dir() else []:
            shutil.rmtree(stale, ignore_errors=True)  # left by a writer that was killed
        stage.mkdir(parents=True)
    barrier()
    rngs = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(rngs, rng_state())
    else:
        rngs[0] = rng_state()
    tconf = trainer.config
    try:
        save_checkpoint(trainer.chunks, stage / MODEL_DIR, family=family, diffusers_config=diffusers_config,
                        optimizer=trainer.optimizer, shadows=shadows, checksum=checksum)
        faults.check("checkpoint", iteration)
        if rank() == 0:
            state = {"iteration": iteration, "prompts_consumed": prompts_consumed, "rng": rngs,
                     "metrics": metrics_rows, "layout": {"tp": tconf.tensor_model_parallel_size,
                                                         "pp": tconf.pipeline_model_parallel_size},
                     "shadow_updates": {name: shadow.num_updates for name, shadow in (shadows or {}).items()},
                     **({"algorithm": algorithm} if algorithm else {})}
            _finish(stage, checkpoint_dir(run_dir, iteration).absolute(), state, write_extra, checksum)
    except BaseException as e:
        failure = _not_saved(e, run_dir, stage, iteration)
        if failure is e:
            raise
        raise failure from None
    if rank() == 0:
        for _, old in list_checkpoints(run_dir)[:-keep]:
            remove_checkpoint(old)  # renamed away first: an export reading it sees it gone, not half-deleted
    barrier()
    return time.perf_counter() - t0


def _finish(stage: Path, final: Path, state: dict, write_extra, checksum: str) -> None:
    """Rank 0: the run's files into the staging dir (the batch collected ahead, state.json), the manifest last,
    then the staging dir renamed to ``final``."""
    if write_extra is not None:
        write_extra(stage)
    with open(stage / STATE_FILE, "w") as fh:
        json.dump(state, fh, default=float)
        fh.flush()
        os.fsync(fh.fileno())
    write_manifest(stage, checksum)  # lists state.json and model/MANIFEST.json (which lists the model's files)
    if final.exists():  # re-written after a resume from an older checkpoint
        remove_checkpoint(final)
    os.rename(stage, final)


def _not_saved(error: BaseException, run_dir: Path, stage: Path, iteration: int) -> BaseException:
    """After a failed save: rank 0 removes the staging dir; a full disk becomes one NoSpace line naming the
    checkpoint, the bytes it needs and the checkpoint kept; any other error is returned as it is."""
    from megaflow.trainer.disk_full import NoSpace, disk_full, tree_bytes

    final = checkpoint_dir(run_dir, iteration).absolute()
    written = tree_bytes(stage)
    full = error if isinstance(error, NoSpace) else disk_full(error, final, written, written=written)
    if rank() == 0:
        shutil.rmtree(stage, ignore_errors=True)
    if full is None:
        return error
    kept = list_checkpoints(run_dir)
    then = f"; nothing of it is left, {kept[-1][1]} is still the latest checkpoint" if kept else \
        "; nothing of it is left (the run has no checkpoint yet)"
    return NoSpace(final, full.needed, full.free, final.parent, then)


def load(trainer, ckpt: Path, *, shadows: dict | None = None, trust: bool = False) -> dict:
    """Collective: load model + optimizer (+ ``shadows``) from ``ckpt``, restore RNG states, return the state.
    Rank 0 checks the checkpoint first and a refusal is raised on every rank; ``trust`` loads one without a manifest."""
    from megaflow.trainer.checkpoint import load_checkpoint

    _checked_on_rank0(ckpt, trust)
    state = read_state(ckpt)
    tconf = trainer.config
    layout = {"tp": tconf.tensor_model_parallel_size, "pp": tconf.pipeline_model_parallel_size}
    if state.get("layout", layout) != layout:
        raise ValueError(f"{ckpt}: saved at {state['layout']}, resuming at {layout}: the optimizer state "
                         "reshards across data parallelism only; resume at the same tp/pp")
    saved = state.get("shadow_updates", {})
    for name, shadow in (shadows or {}).items():
        if name not in saved:
            raise ValueError(f"{ckpt} holds no {name!r} weights (the run that wrote it had them off)")
        shadow.num_updates = int(saved[name])
    rngs = state["rng"]
    if len(rngs) != (dist.get_world_size() if dist.is_initialized() else 1):
        raise ValueError(f"{ckpt}: saved by {len(rngs)} ranks; resume with the same number of processes")
    load_checkpoint(trainer.chunks, ckpt / MODEL_DIR, optimizer=trainer.optimizer, shadows=shadows,
                    trust=trust, checked_manifest=True)  # the manifest checked above, model/ included
    try:
        set_rng_state(rngs[rank()])
    except (ValueError, TypeError, RuntimeError, SyntaxError, MemoryError, RecursionError) as e:
        raise ValueError(f"{ckpt / STATE_FILE}: rank {rank()}'s RNG state is unusable "
                         f"({type(e).__name__}: {str(e)[:120]})") from None
    return state


def _checked_on_rank0(ckpt: Path, trust: bool) -> None:
    """Rank 0 checks ``ckpt``: its manifest (corruption), its state.json (types, ranges) and, unless ``trust``, its
    model's DCP metadata (megaflow.trainer.dcp_metadata), the model's tensors at their shapes among it; the
    ValueError (one line) is raised on every rank."""
    error = [None]
    if rank() == 0:
        try:
            verify_manifest(ckpt, trust=trust)
            read_state(ckpt)
            if not trust:  # the model's tensors at the shapes its family and config give them
                from megaflow.trainer.checkpoint import META_FILE, read_meta
                from megaflow.trainer.dcp_metadata import check_dcp_metadata
                from megaflow.trainer.model_tensors import model_shapes
                shapes = model_shapes(read_meta(ckpt / MODEL_DIR), ckpt / MODEL_DIR / META_FILE)
                check_dcp_metadata(ckpt / MODEL_DIR, shapes=shapes)
        except ValueError as e:
            error[0] = str(e)
    if dist.is_initialized():
        dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise ValueError(error[0])
