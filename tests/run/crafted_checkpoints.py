"""Crafted checkpoints for tests/run/test_checkpoint_trust.py: the cheapest real run checkpoint megaflow writes
(:func:`save_run_checkpoint`, in this process, no engine), and the hostile or broken variants of one
(``CRAFTS``), each written over a copy and sealed with megaflow's own manifest writer, as anyone who can write a
checkpoint can do. A payload, if it ever ran, would create ``marker``."""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
from pathlib import Path

ITERATION = 1


class RunsCode:
    """Unpickling this runs ``os.system`` (what a crafted checkpoint would do): it creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def save_run_checkpoint(root: Path):
    """A run dir ``root/run`` (its tiny pipeline, config.toml and checkpoint ``ITERATION`` written by
    megaflow.rundir.checkpoint_io.save from a Trainer with its optimizer, built in this process on a 1-rank gloo
    group) and that trainer. The caller destroys the process group (megaflow.parallel.distributed.destroy_distributed)."""
    from megaflow.config import load_config, save_config
    from megaflow.models.tiny_pipeline import make_tiny_pipeline
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import init_distributed
    from megaflow.rundir import checkpoint_io
    from megaflow.run.build import build_trainer

    run_dir = root / "run"
    pipeline = make_tiny_pipeline("sd3", run_dir / "tiny-pipeline", seed=0)
    cfg = load_config(None, [f'run.output_dir="{root}"', 'run.name="run"', "train.iterations=3"])
    save_config(cfg, run_dir)
    init_distributed(ParallelDims(), seed=0)
    trainer, _ = build_trainer(cfg, pipeline)
    dconfig = json.loads((pipeline / "transformer" / "config.json").read_text())
    checkpoint_io.save(trainer, run_dir, ITERATION, family="sd3", diffusers_config=dconfig, prompts_consumed=4,
               metrics_rows=[{"iteration": ITERATION}], keep=2)
    return run_dir, trainer


def checkpoint_of(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / f"iter_{ITERATION:06d}"


def reseal(ckpt: Path) -> None:
    """Rewrite the manifests of ``ckpt`` (model/ first, then the checkpoint's) with megaflow's writer."""
    from megaflow.trainer.manifest import write_manifest
    write_manifest(ckpt / "model")
    write_manifest(ckpt)


def _edit_metadata(ckpt: Path, edit) -> None:
    """Unpickle our own ``model/.metadata`` (written by the fixture), ``edit(metadata)``, pickle it back."""
    path = ckpt / "model" / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # noqa: S301 - the fixture's own file
    edit(metadata)
    path.write_bytes(pickle.dumps(metadata))


def _storage(metadata, *, byte_item: bool):
    """(index, storage info) of the first byte item (``byte_item``) or tensor chunk."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    for index, info in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata) == byte_item:
            return index, info
    raise AssertionError("no such item")


def _restore(metadata, *, byte_item: bool, **changes) -> None:
    index, info = _storage(metadata, byte_item=byte_item)
    metadata.storage_data[index] = dataclasses.replace(info, **changes)


def _first_tensor(metadata):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    return next(v for v in metadata.state_dict_metadata.values() if isinstance(v, TensorStorageMetadata))


def _payload(ckpt: Path, marker: Path) -> None:
    def edit(metadata):
        metadata.storage_meta = RunsCode(marker)
    _edit_metadata(ckpt, edit)


def _truncate_distcp(ckpt: Path, marker: Path) -> None:
    [distcp] = (ckpt / "model").glob("*.distcp")
    with open(distcp, "r+b") as fh:
        fh.truncate(distcp.stat().st_size // 2)


def _state(**changes):
    def craft(ckpt: Path, marker: Path) -> None:
        path = ckpt / "state.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return craft


def _plain_pt(ckpt: Path, marker: Path) -> None:
    """The model as one torch.save file (what a plain PyTorch training script writes) instead of a dist checkpoint;
    megaflow_model.json kept. It holds a payload: torch.load without weights_only would run it."""
    import torch
    for f in (ckpt / "model").iterdir():
        if f.name != "megaflow_model.json":
            f.unlink()
    torch.save({"weight": torch.zeros(2), "payload": RunsCode(marker)}, ckpt / "model" / "model.pt")


def _numpy_rng(position):
    def craft(ckpt: Path, marker: Path) -> None:
        path = ckpt / "state.json"
        state = json.loads(path.read_text())
        state["rng"][0]["numpy"][2] = position
        path.write_text(json.dumps(state))
    return craft


SPARSE = 2**28  # bytes a sparse file claims (256 MiB; the reads refuse it before allocating, whatever its size)


def _sparse_tensor(name: str):
    """``model/huge.distcp``, a sparse file of ``SPARSE`` bytes, holding float32 tensor ``name`` of SPARSE / 4
    elements (a new one, or one of the model's resized)."""
    def craft(ckpt: Path, marker: Path) -> None:
        import torch
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                           TensorStorageMetadata)
        with open(ckpt / "model" / "huge.distcp", "wb") as fh:
            fh.truncate(SPARSE)
        size = torch.Size([SPARSE // 4])

        def edit(metadata):
            chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=size)
            metadata.state_dict_metadata[name] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), size,
                                                                       [chunk])
            metadata.storage_data[MetadataIndex(name, chunk.offsets)] = _StorageInfo("huge.distcp", 0, SPARSE)
        _edit_metadata(ckpt, edit)
    return craft


def _sparse_byte_item(ckpt: Path, marker: Path) -> None:
    """The first byte item moved onto ``model/huge.distcp``, a sparse file, claiming 2 * 64 MiB."""
    with open(ckpt / "model" / "huge.distcp", "wb") as fh:
        fh.truncate(2 * 64 << 20)
    _edit_metadata(ckpt, lambda m: _restore(m, byte_item=True, relative_path="huge.distcp", offset=0,
                                            length=2 * 64 << 20))


def _metadata(edit):
    def craft(ckpt: Path, marker: Path) -> None:
        _edit_metadata(ckpt, edit)
    return craft


# name -> (craft(checkpoint dir, marker), what the one-line refusal names). The metadata crafts: megaflow's own
# checkpoint with one field changed.
CRAFTS = {
    "__reduce__ payload in .metadata": (_payload, "posix.system, which checkpoint metadata never holds"),
    "absolute storage path": (_metadata(lambda m: _restore(m, byte_item=False, relative_path="/etc/passwd")),
                              "storage path '/etc/passwd'"),
    "../ storage path": (_metadata(lambda m: _restore(m, byte_item=False, relative_path="../../../../etc/passwd")),
                         "is not inside the checkpoint"),
    "offset 10**18": (_metadata(lambda m: _restore(m, byte_item=False, offset=10**18)), "which has"),
    "length 10**15": (_metadata(lambda m: _restore(m, byte_item=False, length=10**15)), "which has"),
    "byte item on /dev/zero, 2**36": (_metadata(lambda m: _restore(m, byte_item=True, relative_path="/dev/zero",
                                                                   length=2**36)), "storage path '/dev/zero'"),
    'size="abc"': (_metadata(lambda m: setattr(_first_tensor(m), "size", "abc")), "has size 'abc'"),
    "chunks=None": (_metadata(lambda m: setattr(_first_tensor(m), "chunks", None)), "has chunks None"),
    "truncated .distcp": (_truncate_distcp, "(truncated or altered)"),
    ".metadata a dict": (lambda ckpt, marker: (ckpt / "model" / ".metadata").write_bytes(pickle.dumps(
        {"state_dict_metadata": {}, "storage_data": {}})), "holds a dict, not torch checkpoint metadata"),
    "state_dict_metadata a list": (_metadata(lambda m: setattr(m, "state_dict_metadata", [1, 2])),
                                   "state_dict_metadata and storage_data must be dicts"),
    "state_dict_metadata missing": (_metadata(lambda m: delattr(m, "state_dict_metadata")),
                                    "state_dict_metadata and storage_data must be dicts"),
    "storage_data a string": (_metadata(lambda m: setattr(m, "storage_data", "abc")),
                              "state_dict_metadata and storage_data must be dicts"),
    "planner_data a list": (_metadata(lambda m: setattr(m, "planner_data", [1])), "planner_data is a list, not a"),
    "version a dict": (_metadata(lambda m: setattr(m, "version", {})), "version is a dict"),
    "an unknown tensor on a sparse file": (_sparse_tensor("huge.weight"),
                                           "tensor 'huge.weight' of shape (67108864,), which a sd3 model of its "
                                           "config does not have; not read"),
    "a model tensor resized onto a sparse file": (_sparse_tensor("final_proj.bias"), "the model's is (64,)"),
    "a byte item of 128 MiB on a sparse file": (_sparse_byte_item, "takes 134217728 bytes, more than the 67108864"),
    "a plain .pt, no .metadata": (_plain_pt, "checkpoint (.metadata not found)"),
    'state.json iteration="4"': (_state(iteration="4"), "iteration = '4': want an integer >= 1"),
    "state.json prompts_consumed=-3": (_state(prompts_consumed=-3), "prompts_consumed = -3: want an integer >= 0"),
    "state.json numpy RNG position 10**30": (_numpy_rng(10**30), "as python, numpy and torch give them"),
    "state.json numpy RNG position a string": (_numpy_rng("624"), "as python, numpy and torch give them"),
    "state.json metrics row's reward a list": (_state(metrics=[{"iteration": 1, "reward/total": [1]}]),
                                               "want a list of metrics rows"),
}
STATE_CRAFTS = tuple(name for name in CRAFTS if name.startswith("state.json"))
# What only a one-process read of the whole model refuses (a resume reads the tensors its trainer has, by name).
WHOLE_MODEL_CRAFTS = ("an unknown tensor on a sparse file",)


def crafted_copy(run_dir: Path, dest: Path, name: str, marker: Path) -> Path:
    """A copy of the run dir at ``dest`` whose checkpoint has the craft ``name``, resealed; its checkpoint dir."""
    shutil.copytree(run_dir, dest, symlinks=True)
    ckpt = checkpoint_of(dest)
    CRAFTS[name][0](ckpt, marker)
    reseal(ckpt)
    return ckpt
