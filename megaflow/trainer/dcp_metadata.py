"""The pickles in a torch distributed checkpoint, checked before torch reads them. Its ``.metadata`` is a plain
pickle that torch's reader loads with ``pickle``, and every non-tensor item (megatron's ``_extra_state``, the
optimizer's common state) is a ``torch.save`` blob inside a ``.distcp`` file that torch's default planner loads
with ``weights_only=False``: a crafted file runs code when a checkpoint is loaded. :func:`check_dcp_metadata`
first unpickles ``.metadata`` with an allow-list of what such metadata holds -- the classes of torch's
``distributed.checkpoint`` metadata, planner and filesystem modules, ``torch.Size``, torch dtypes and layouts,
paths -- then reads every byte item it lists with ``torch.load(weights_only=True)``, and refuses anything else in
one line, with nothing of it run. The manifest (megaflow.trainer.manifest) is checked first; ``--trust-checkpoint``
skips these checks.
"""
from __future__ import annotations

import importlib
import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from megaflow.trainer.manifest import TRUST_HINT

METADATA = ".metadata"
CLASS_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                 "torch.distributed.checkpoint.filesystem")
NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
         ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}  # storage_meta.checkpoint_id


def _allowed(module: str, name: str) -> bool:
    if (module, name) in NAMES:
        return True
    if module == "torch":
        return isinstance(getattr(torch, name, None), torch.dtype)
    if module in CLASS_MODULES:
        return isinstance(getattr(importlib.import_module(module), name, None), type)
    return False


class _Refused(pickle.UnpicklingError):
    """A global outside the allow-list (its dotted name)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if not _allowed(module, name):
            raise _Refused(f"{module}.{name}")
        return super().find_class(module, name)


def check_dcp_metadata(directory: str | Path) -> None:
    """Unpickle ``directory/.metadata`` with the allow-list, then each byte item it lists with
    ``weights_only=True``; ValueError of one line naming the file and the first name outside the allow-list, the
    item that needs more, or why the file does not unpickle. No ``.metadata``: nothing to check (torch says what
    is missing)."""
    path = Path(directory) / METADATA
    if not path.is_file():
        return
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except _Refused as e:
        raise ValueError(f"{path}: names {e}, which checkpoint metadata never holds: not unpickled; "
                         f"{TRUST_HINT}") from None
    except Exception as e:  # noqa: BLE001 - any other failure of a damaged pickle: one line
        raise ValueError(f"{path}: unreadable checkpoint metadata ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{path}: holds a {type(metadata).__name__}, not torch checkpoint metadata")
    _check_byte_items(Path(directory), metadata)


def _check_byte_items(directory: Path, metadata) -> None:
    """Every ``BytesStorageMetadata`` item of ``metadata`` loads with ``torch.load(weights_only=True)``."""
    for fqn, item in metadata.state_dict_metadata.items():
        if not isinstance(item, BytesStorageMetadata):
            continue
        info = metadata.storage_data.get(MetadataIndex(fqn))
        where = directory / str(getattr(info, "relative_path", "?"))
        try:
            if getattr(info, "transform_descriptors", None):
                raise ValueError("stored transformed (compressed), not checked here")
            with open(where, "rb") as fh:
                fh.seek(info.offset)
                blob = fh.read(info.length)
            torch.load(io.BytesIO(blob), weights_only=True)
        except Exception as e:  # noqa: BLE001 - whatever refused it: one line
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(f"{where}: item {fqn!r} does not load with torch.load(weights_only=True) ({why[:200]}); "
                             f"not unpickled; {TRUST_HINT}") from None
