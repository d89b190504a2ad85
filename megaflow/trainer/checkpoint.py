"""Model (and optimizer) checkpoints in megatron's dist_checkpointing format, by GLOBAL name, so a checkpoint
saved at one TP/PP/VPP layout loads at any other; ``megaflow_model.json`` records family and diffusers config.

Invariant: writes are atomic (every rank writes ``<dst>.tmp-<id>``, rank 0 renames after a barrier), synchronous,
and start no process. Design notes: docs/design/trainer.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps

from megaflow.config.files import CKPT_META as META_FILE  # the one home of the name (stdlib-only room)
from megaflow.checksum import DEFAULT as DEFAULT_CHECKSUM
from megaflow.models.common.finite import refuse_non_finite
from megaflow.parallel.distributed import barrier, rank
from megaflow.trainer.dcp_metadata import reading
from megaflow.trainer.disk_full import checkpoint_bytes, disk_full, tree_bytes, writer_failures_raised_not_logged
from megaflow.trainer.manifest import verify_manifest, write_manifest
from megaflow.trainer.offload import inner_torch_optimizers

# Optimizer state as megatron's DistributedOptimizer buffers: fully parallel save/load, reshardable
# across DP only (resume at the same TP/PP). "fully_reshardable" (any layout) calls .cuda() in
# get_parameter_state_dp_zero, which megaflow.parallel.cpu does not shim yet; megatron's default
# ("fully_sharded_model_space") is deprecated and fails (flattened_range unsupported).
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
FORMAT_VERSION = 1


def _model_sharded_state_dict(chunks: list[torch.nn.Module]) -> dict:
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def _shadow_sharded_state_dict(chunks: list[torch.nn.Module], name: str, shadow) -> tuple[dict, dict]:
    """The sharded entries of a ShadowWeights (megaflow.trainer.shadow) under ``<name>.<global tensor name>``:
    the model's own ShardedTensors (same global shapes and TP offsets, so any layout can read them) with the
    shadow's fp32 tensors as data. Returns (sharded dict, checkpoint key -> shadow tensor name)."""
    out, names = {}, {}
    for i, chunk in enumerate(chunks):
        by_ptr = {p.data_ptr(): f"{i}.{n}" for n, p in chunk.named_parameters() if p.requires_grad}
        for key, entry in chunk.sharded_state_dict(prefix=f"{name}.").items():
            data = getattr(entry, "data", None)
            tensor_name = by_ptr.pop(data.data_ptr(), None) if isinstance(data, torch.Tensor) else None
            if tensor_name is not None:
                tensor = shadow.tensors[tensor_name]
                out[key] = dataclasses.replace(entry, data=tensor, dtype=tensor.dtype)
                names[key] = tensor_name
        if by_ptr:
            raise ValueError(f"{name}: no sharded tensor for {sorted(by_ptr.values())[:3]} in the model's state")
    return out, names


def _agree_on_tmp_dir(dst: Path) -> Path:
    """A fresh temp dir next to ``dst``, the same on every rank (rank 0 picks it)."""
    name = [f"{dst.name}.tmp-{uuid.uuid4().hex[:8]}"]
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(name, src=0)
    tmp = dst.parent / name[0]
    if rank() == 0:
        tmp.mkdir(parents=True)
    barrier()
    return tmp


def write_meta(directory: Path, *, family: str, diffusers_config: dict) -> None:
    """Write ``megaflow_model.json`` (family + diffusers config) into ``directory``."""
    meta = {"format": FORMAT_VERSION, "family": family, "diffusers_config": diffusers_config}
    (directory / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))


def read_meta(path: str | Path) -> dict:
    """The checkpoint's ``megaflow_model.json``; ValueError if ``path`` is not a megaflow checkpoint."""
    meta_path = Path(path) / META_FILE
    if not meta_path.is_file():
        raise ValueError(f"{path} is not a megaflow checkpoint ({META_FILE} not found)")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"{meta_path}: unreadable ({type(e).__name__})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"{meta_path}: unsupported format {_format_of(meta)} (expected {FORMAT_VERSION})")
    return meta


def _format_of(meta: object) -> str:
    return repr(meta.get("format"))[:40] if isinstance(meta, dict) else f"(a {type(meta).__name__})"


def publish(tmp: Path, dst: Path) -> None:
    """Move a finished temp dir to ``dst`` (replacing an old ``dst``); rank 0 only."""
    if dst.exists():
        old = dst.parent / f"{dst.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(dst, old)
        os.rename(tmp, dst)
        shutil.rmtree(old)
    else:
        os.rename(tmp, dst)


def _results_queue_in_process() -> None:
    """A plain ``queue.Queue`` for megatron's writer results instead of a Manager process (docs/design/trainer.md)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(chunks: list[torch.nn.Module], path: str | Path, *, family: str, diffusers_config: dict,
                    optimizer=None, shadows: dict | None = None, checksum: str = DEFAULT_CHECKSUM) -> Path:
    """Collective: save this rank's model chunks (unwrapped), optionally the optimizer state and shadow weights
    (``shadows``: name -> megaflow.trainer.shadow.ShadowWeights, e.g. the EMA, stored as ``<name>.<tensor>``);
    a ``MANIFEST.json`` of every file (``checksum`` digests, megaflow.trainer.manifest) is written last."""
    _results_queue_in_process()
    dst = Path(path).absolute()
    tmp = _agree_on_tmp_dir(dst)
    state = _model_sharded_state_dict(chunks)
    for name, shadow in (shadows or {}).items():
        state[name] = _shadow_sharded_state_dict(chunks, name, shadow)[0]
    if optimizer is not None:
        _init_adam_state(optimizer)  # an optimizer that never stepped (every update skipped) has no state yet
        state["optimizer"] = optimizer.sharded_state_dict(state, metadata=_OPTIMIZER_METADATA)
    needed = checkpoint_bytes(state)
    try:
        with writer_failures_raised_not_logged():
            dist_checkpointing.save(state, str(tmp))
    except BaseException as e:  # torch's CheckpointException (a BaseException) hides the OS error of a full disk
        full = disk_full(e, dst, needed, written=tree_bytes(tmp))
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            raise full from None
        raise
    barrier()
    if rank() == 0:
        write_meta(tmp, family=family, diffusers_config=diffusers_config)
        write_manifest(tmp, checksum)
        publish(tmp, dst)
    barrier()
    return dst


def _model_shapes(state: dict) -> dict[str, tuple]:
    """Global shape of every sharded tensor of a sharded state dict, by checkpoint key."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {t.key: tuple(t.global_shape) for t in nested_values(state) if isinstance(t, ShardedTensor)}


def load_checkpoint(chunks: list[torch.nn.Module], path: str | Path, *, optimizer=None,
                    shadows: dict | None = None, trust: bool = False, checked_manifest: bool = False) -> dict:
    """Collective: load model chunks (any TP/PP layout), optionally optimizer and shadows; returns meta. Checked
    against the manifest first (unless ``checked_manifest``), read under dcp_metadata's trust rule (``trust``)."""
    if not checked_manifest:
        verify_manifest(path, trust=trust)
    meta = read_meta(path)
    state = _model_sharded_state_dict(chunks)
    shadow_names = {}
    for name, shadow in (shadows or {}).items():
        state[name], shadow_names[name] = _shadow_sharded_state_dict(chunks, name, shadow)
    if optimizer is not None:
        _init_adam_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=_OPTIMIZER_METADATA)
    with reading(path, trust=trust, shapes=_model_shapes(state)):
        loaded = dist_checkpointing.load(state, str(path))
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for key, chunk in zip(keys, chunks):
        chunk.load_state_dict(loaded[key], strict=True)
    _refuse_non_finite_everywhere(chunks, path)
    with torch.no_grad():
        for name, shadow in (shadows or {}).items():
            for key, tensor_name in shadow_names[name].items():
                shadow.tensors[tensor_name].copy_(loaded[name][key])
    if optimizer is not None:
        _take_current_lr(optimizer, loaded["optimizer"])
        with torch.no_grad():  # it copies into views of the (leaf) main params
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(optimizer)
    return meta


def _refuse_non_finite_everywhere(chunks: list[torch.nn.Module], path: str | Path) -> None:
    """Every rank raises the same one-line ValueError when any rank's loaded shard holds NaN or inf (a rank that
    raised alone would leave the others waiting in the next collective)."""
    import torch.distributed as dist
    try:
        refuse_non_finite((n, p) for chunk in chunks for n, p in chunk.named_parameters())
        mine = None
    except ValueError as e:
        mine = f"{path}: {e}"
    found = [mine]
    if dist.is_initialized():
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
    bad = next((m for m in found if m), None)
    if bad:
        raise ValueError(bad)


@contextlib.contextmanager
def _process_group_for_reading():
    """A 1-process gloo group (in-memory store) if none exists: megatron's readers need one."""
    if torch.distributed.is_initialized():
        yield
        return
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


_LR_KEYS = ("max_lr", "min_lr")


def _take_current_lr(optimizer, saved) -> None:
    """A run resumed with another ``train.lr``: megatron pairs each saved param group with the current one by the
    group's settings, the learning rate it was built with among them; a saved group that differs from a current
    one only there takes the current group's (the schedule sets every iteration's rate: trainer/settings.py)."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys
    others = [k for k in param_group_identifier_keys if k not in _LR_KEYS]
    wrappers = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [saved] if len(wrappers) == 1 else [v for _, v in sorted(saved.items())] if isinstance(saved, dict) \
        else list(saved)
    for wrapper, state in zip(wrappers, states):
        current = {tuple(g.get(k) for k in others): g for g in wrapper.optimizer.param_groups}
        for group in state.get("optimizer", {}).get("param_groups", []) if isinstance(state, dict) else []:
            match = current.get(tuple(group.get(k) for k in others))
            if match is not None:
                group.update({k: match[k] for k in _LR_KEYS if k in match})


def _init_adam_state(optimizer) -> None:
    """Give a fresh torch Adam(W) inside a megatron optimizer its (zero) state, 'step' included:
    without apex/TE, megatron's DistributedOptimizer.state_dict() reads 'step' from every param
    state, which a never-stepped torch optimizer does not have yet."""
    for inner in inner_torch_optimizers(optimizer):
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p.data),
                                          exp_avg_sq=torch.zeros_like(p.data))


def _restore_adam_steps(optimizer) -> None:
    """Give every param of a torch Adam(W) its own 'step' tensor from its param group (docs/design/trainer.md)."""
    for inner in inner_torch_optimizers(optimizer):
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                if "step" in inner.state[p]:
                    inner.state[p]["step"] = torch.tensor(float(group["step"]))


def load_full_state_dict(path: str | Path, *, shadow: str | None = None, trust: bool = False,
                         checked_manifest: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, {global name: full tensor}) of a checkpoint's MODEL tensors in one process, without a model;
    ``shadow``: its tensors replace the model's (ValueError when absent). Checked as ``load_checkpoint`` does, and
    only the tensors the model has, at its shapes, are allocated and read (megaflow.trainer.model_tensors)."""
    import torch.distributed.checkpoint as dcp

    from megaflow.trainer.model_tensors import model_shapes, tensors_to_read

    path = Path(path)
    if not checked_manifest:
        verify_manifest(path, trust=trust)
    meta = read_meta(path)
    with reading(path, trust=trust) as metadata:
        expected = model_shapes(meta, path / META_FILE)
        wanted = tensors_to_read(path, metadata, expected, meta["family"], shadow)
        tensors = {k: torch.empty(tuple(item.size), dtype=item.properties.dtype) for k, item in wanted.items()}
        with _process_group_for_reading():
            dcp.load(tensors, checkpoint_id=str(path))
    model = {k: v for k, v in tensors.items() if shadow is None or k.split(".", 1)[0] != shadow}
    if shadow is not None:
        overlay = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.split(".", 1)[0] == shadow}
        if not overlay:
            raise ValueError(f"{path} holds no {shadow!r} weights")
        model.update({k: v.to(model[k].dtype) if k in model else v for k, v in overlay.items()})
    return meta, model


def save_from_diffusers(diffusers_dir: str, tmp_dir: str, dims_kwargs: dict, family: str) -> bool:
    """Rank function of ``tools/convert_checkpoint.py to-megatron``: build this rank's chunks at the
    requested layout, load the diffusers weights, and save into the agreed ``tmp_dir``."""
    from megaflow.models.provider import build_model_chunks
    from megaflow.models.registry import get_family
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import destroy_distributed, init_distributed
    from megaflow.trainer.runner import load_checked

    dims = ParallelDims(**dims_kwargs)
    init_distributed(dims)
    fam = get_family(family)
    dconfig = json.loads((Path(diffusers_dir) / "config.json").read_text())
    config = fam.config_from_diffusers(
        dconfig, tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp, perform_initialization=False,
    )
    full = fam.weight_map.to_megatron_full(read_diffusers_weights(diffusers_dir), config)
    chunks = build_model_chunks(config, family=family, spec="local")
    for chunk in chunks:
        local = fam.weight_map.select_local(
            full, config, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=dims.tp,
            pp_rank=chunk.pp_rank, vp_stage=chunk.vp_stage)
        load_checked(chunk, local)
    dist_checkpointing.save(_model_sharded_state_dict(chunks), tmp_dir)
    destroy_distributed()
    return True


def read_diffusers_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a diffusers model dir (single or sharded safetensors); ValueError if none."""
    from safetensors.torch import load_file

    directory = Path(directory)
    index = directory / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["diffusion_pytorch_model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    for name in files:
        if not (directory / name).is_file():
            raise ValueError(f"{directory / name} not found")
        out.update(load_file(str(directory / name)))
    return out
