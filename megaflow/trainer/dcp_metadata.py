"""The one trust rule for reading a torch distributed checkpoint: every megaflow path that reads one reads it
inside :func:`reading`; torch unpickles its metadata and non-tensor items, so unless ``--trust-checkpoint``,
:func:`check_dcp_metadata` checks first. Design notes: docs/design/trainer.md.
"""
from __future__ import annotations

import contextlib
import io
import math
import pickle
import reprlib
import threading
from pathlib import Path, PurePosixPath

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)

from megaflow.trainer.manifest import TRUST_HINT

METADATA = ".metadata"
_DCP = "torch.distributed.checkpoint"
ALLOWED = {
    f"{_DCP}.metadata": {"Metadata", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
                         "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "_MEM_FORMAT_ENCODING"},
    f"{_DCP}.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"},
    f"{_DCP}.filesystem": {"_StorageInfo"},
    "torch": {"Size"},  # and every torch dtype (_allowed)
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath"},  # storage_meta.checkpoint_id
}
MAX_BYTE_ITEM = 64 << 20  # bytes of one non-tensor item, read whole into memory to be checked
_PROPERTIES = {"dtype", "layout", "requires_grad", "memory_format", "pin_memory"}
_short = reprlib.Repr(maxstring=60, maxother=60, maxlist=4, maxtuple=4, maxlevel=2).repr


def _allowed(module: str, name: str) -> bool:
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return True
    return name in ALLOWED.get(module, ())


class _Refused(pickle.UnpicklingError):
    """A global outside the allow-list (its dotted name)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if not _allowed(module, name):
            raise _Refused(f"{module}.{name}")
        return super().find_class(module, name)


def read_metadata(path: Path) -> Metadata:
    """``path`` (a ``.metadata`` file) unpickled through the allow-list; ValueError of one line otherwise."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except _Refused as e:
        raise ValueError(f"{path}: names {e}, which checkpoint metadata never holds: not unpickled; "
                         f"{TRUST_HINT}") from None
    except Exception as e:  # noqa: BLE001 - any other failure of a damaged pickle: one line
        raise ValueError(f"{path}: unreadable checkpoint metadata ({type(e).__name__}: {_short(str(e))})") from None
    if type(metadata) is not Metadata:
        raise ValueError(f"{path}: holds a {type(metadata).__name__}, not torch checkpoint metadata")
    return metadata


def check_dcp_metadata(directory: str | Path, *, shapes: dict[str, tuple] | None = None) -> Metadata:
    """The checked metadata of the checkpoint ``directory`` (the module's design notes): allow-list, fields, storage,
    chunks, ``shapes`` (tensor name -> the global shape a model needs; None: not compared), byte items. ValueError
    of one line naming the file and the first thing refused."""
    directory = Path(directory)
    path = directory / METADATA
    if not path.is_file():
        raise ValueError(f"{directory} is not a torch distributed checkpoint ({METADATA} not found)")
    metadata = read_metadata(path)
    _Validator(directory, metadata).run(shapes)
    _check_byte_items(directory, metadata)
    return metadata


def _size(value: object) -> bool:
    """A torch.Size of ints >= 0."""
    return type(value) is torch.Size and all(type(d) is int and d >= 0 for d in value)


def _properties(props: object) -> bool:
    """TensorProperties as torch writes them (megatron passes their fields to ``torch.empty``)."""
    return (type(props) is TensorProperties and set(vars(props)) == _PROPERTIES
            and isinstance(props.dtype, torch.dtype) and props.layout is torch.strided
            and isinstance(props.memory_format, torch.memory_format)
            and type(props.requires_grad) is bool and type(props.pin_memory) is bool)


class _Validator:
    """The checks of one ``.metadata`` against its directory (``run``); ``bad(what)`` raises."""

    def __init__(self, directory: Path, metadata: Metadata):
        self.directory, self.metadata, self.path = directory, metadata, directory / METADATA
        self.root = directory.resolve()
        self.file_sizes: dict[str, int] = {}

    def bad(self, what: str) -> None:
        raise ValueError(f"{self.path}: {what}; refused before any of its data is read")

    def run(self, shapes: dict[str, tuple] | None) -> None:
        md = self.metadata
        if type(getattr(md, "state_dict_metadata", None)) is not dict or type(md.storage_data) is not dict:
            self.bad("state_dict_metadata and storage_data must be dicts")
        if md.storage_meta is not None and type(md.storage_meta) is not StorageMeta:
            self.bad(f"storage_meta is a {type(md.storage_meta).__name__}")
        if md.version is not None and type(md.version) is not str:
            self.bad(f"version is a {type(md.version).__name__}")
        self._planner_data(md.planner_data)
        for index, info in md.storage_data.items():
            self._storage(index, info)
        for fqn, item in md.state_dict_metadata.items():
            if type(fqn) is not str:
                self.bad(f"an item named {_short(fqn)}, not a string")
            if type(item) is BytesStorageMetadata:
                length = self._stored(MetadataIndex(fqn), fqn).length
                if length > MAX_BYTE_ITEM:
                    self.bad(f"item {fqn!r} takes {length} bytes, more than the {MAX_BYTE_ITEM} megaflow allows one "
                             "(its items are KB of optimizer and layer settings)")
            elif type(item) is TensorStorageMetadata:
                self._tensor(fqn, item)
            else:
                self.bad(f"item {fqn!r} is a {type(item).__name__}, not tensor or bytes metadata")
        for fqn, shape in (shapes or {}).items():
            item = md.state_dict_metadata.get(fqn)
            if type(item) is not TensorStorageMetadata:
                self.bad(f"holds no tensor {fqn!r}, which the model needs")
            if tuple(item.size) != tuple(shape):
                self.bad(f"tensor {fqn!r} has shape {tuple(item.size)}, the model's is {tuple(shape)}")

    def _planner_data(self, data: object) -> None:
        """None, or what torch's planner writes: each item's name -> the path of keys it was flattened from."""
        if data is None:
            return
        if type(data) is not dict:
            self.bad(f"planner_data is a {type(data).__name__}, not a table of item names")
        for name, path in data.items():
            if type(name) is not str or type(path) is not tuple or not all(type(k) in (str, int) for k in path):
                self.bad(f"planner_data maps {_short(name)} to {_short(path)}, not to a path of keys")

    def _storage(self, index: object, info: object) -> None:
        """One storage_data entry: its key, a relative path to a regular file inside the checkpoint, and an
        offset and length inside that file."""
        if type(index) is not MetadataIndex or type(index.fqn) is not str or (
                index.offset is not None and not _size(index.offset)):
            self.bad(f"a storage key {_short(index)} that is no tensor or item index")
        if type(info) is not _StorageInfo:
            self.bad(f"storage of {index.fqn!r} is a {type(info).__name__}")
        if info.transform_descriptors:
            self.bad(f"storage of {index.fqn!r} is transformed ({_short(info.transform_descriptors)}), which "
                     "megaflow never writes")
        rel = info.relative_path
        if type(rel) is not str or not rel or "\0" in rel:
            self.bad(f"storage path {_short(rel)} of {index.fqn!r} is not a file name")
        if rel not in self.file_sizes:
            self.file_sizes[rel] = self._file_size(rel, index.fqn)
        offset, length, size = info.offset, info.length, self.file_sizes[rel]
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            self.bad(f"offset {_short(offset)} / length {_short(length)} of {index.fqn!r} are not byte counts")
        if offset + length > size:
            self.bad(f"{index.fqn!r} lies at bytes {offset}..{offset + length} of {rel}, which has {size} "
                     "(truncated or altered)")

    def _file_size(self, rel: str, fqn: str) -> int:
        parts = PurePosixPath(rel)
        if parts.is_absolute() or ".." in parts.parts:
            self.bad(f"storage path {_short(rel)} of {fqn!r} is not inside the checkpoint")
        target = self.directory / rel
        try:
            inside = target.resolve().is_relative_to(self.root)
            regular = target.is_file()
            size = target.stat().st_size if regular else 0
        except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (Python < 3.13)
            self.bad(f"storage file {_short(rel)} of {fqn!r} is unreadable ({type(e).__name__})")
        if not inside:
            self.bad(f"storage path {_short(rel)} of {fqn!r} leads outside the checkpoint")
        if not regular:
            self.bad(f"storage file {_short(rel)} of {fqn!r} is missing or not a regular file")
        return size

    def _stored(self, index: MetadataIndex, fqn: str) -> _StorageInfo:
        info = self.metadata.storage_data.get(index)
        if info is None:
            self.bad(f"{fqn!r} has no storage entry")
        return info

    def _tensor(self, fqn: str, item: TensorStorageMetadata) -> None:
        """A tensor item: its properties and size, and chunks inside it that cover it exactly, each stored with
        at least its bytes."""
        props = item.properties
        if not _properties(props):
            self.bad(f"tensor {fqn!r} has properties {_short(props)}")
        if not _size(item.size):
            self.bad(f"tensor {fqn!r} has size {_short(item.size)}, not a torch.Size of dimensions")
        chunks = item.chunks
        if type(chunks) is not list or not chunks:
            self.bad(f"tensor {fqn!r} has chunks {_short(chunks)}, not a list of its stored pieces")
        ndim, covered = len(item.size), 0
        boxes = []
        for chunk in chunks:
            if type(chunk) is not ChunkStorageMetadata or not _size(chunk.offsets) or not _size(chunk.sizes) \
                    or len(chunk.offsets) != ndim or len(chunk.sizes) != ndim:
                self.bad(f"tensor {fqn!r} of size {tuple(item.size)} has a chunk {_short(chunk)}")
            if any(o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, item.size)):
                self.bad(f"tensor {fqn!r} of size {tuple(item.size)} has a chunk at {tuple(chunk.offsets)} of "
                         f"{tuple(chunk.sizes)} outside it")
            numel = math.prod(chunk.sizes)
            info = self._stored(MetadataIndex(fqn, chunk.offsets), fqn)
            if info.length < numel * props.dtype.itemsize:
                self.bad(f"chunk {tuple(chunk.offsets)} of tensor {fqn!r} needs {numel * props.dtype.itemsize} "
                         f"bytes, its storage has {info.length}")
            covered += numel
            boxes.append((tuple(chunk.offsets), tuple(chunk.sizes)))
        if covered != math.prod(item.size) or _overlap(boxes):
            held = [b for b in boxes if all(b[1])]
            irregular = len(held) > MAX_IRREGULAR_CHUNKS and len(set(held)) == len(held) and not _grid(held)
            self.bad(f"the chunks of tensor {fqn!r} do not cover its size {tuple(item.size)} exactly once"
                     + (f" (or {len(held)} chunks not in a grid: too many to compare)" if irregular else ""))


MAX_IRREGULAR_CHUNKS = 4096
"""Chunks of one tensor that do not form a grid (torch and megatron write grids) checked pair by pair at most."""


def _overlap(boxes: list[tuple[tuple, tuple]]) -> bool:
    """Whether two of the boxes (offsets, sizes) share an element, in O(n log n) for a grid (what torch and megatron
    write: every dimension cut into abutting intervals, each box one cell); other layouts of up to
    ``MAX_IRREGULAR_CHUNKS`` boxes pair by pair (a sweep along the first dimension), more refused as overlapping."""
    boxes = [b for b in boxes if all(b[1])]  # an empty chunk holds nothing
    if len(set(boxes)) < len(boxes):
        return True  # the same cell twice (two chunks of a 0-d tensor included)
    if _grid(boxes):
        return False
    if len(boxes) > MAX_IRREGULAR_CHUNKS:
        return True
    boxes.sort()
    for i, (off_a, size_a) in enumerate(boxes):
        for off_b, size_b in boxes[i + 1:]:
            if off_b[0] >= off_a[0] + size_a[0]:
                break
            if all(ob < oa + sa and oa < ob + sb for oa, sa, ob, sb in zip(off_a, size_a, off_b, size_b)):
                return True
    return False


def _grid(boxes: list[tuple[tuple, tuple]]) -> bool:
    """Whether the distinct boxes are cells of one grid: in each dimension their intervals, sorted, abut without
    overlapping (so two distinct cells share no element)."""
    for dim in range(len(boxes[0][0]) if boxes else 0):
        intervals = sorted({(off[dim], size[dim]) for off, size in boxes})
        if any(start < prev_start + prev_size for (prev_start, prev_size), (start, _) in zip(intervals, intervals[1:])):
            return False
    return True


def _check_byte_items(directory: Path, metadata: Metadata) -> None:
    """Every byte item loads with ``torch.load(weights_only=True)`` (its storage already checked)."""
    for fqn, item in metadata.state_dict_metadata.items():
        if type(item) is not BytesStorageMetadata:
            continue
        info = metadata.storage_data[MetadataIndex(fqn)]
        where = directory / info.relative_path
        try:
            with open(where, "rb") as fh:
                fh.seek(info.offset)
                torch.load(io.BytesIO(fh.read(info.length)), weights_only=True)
        except Exception as e:  # noqa: BLE001 - whatever refused it: one line
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(f"{where}: item {fqn!r} does not load with torch.load(weights_only=True) ({why[:200]}); "
                             f"not unpickled; {TRUST_HINT}") from None


_PATCH_LOCK = threading.RLock()


@contextlib.contextmanager
def reading(directory: str | Path, *, trust: bool = False, shapes: dict[str, tuple] | None = None):
    """Read the checkpoint ``directory`` with torch / megatron inside this block (the module's design notes): unless
    ``trust``, it is checked first and torch's reads go through the checked metadata and ``weights_only``. Yields
    the metadata: the checked one, or with ``trust`` torch's own read of it."""
    if trust:
        yield FileSystemReader(str(directory)).read_metadata()
        return
    first = check_dcp_metadata(directory, shapes=shapes)
    checked = {(Path(directory) / METADATA).resolve(): first}
    original_read, original_load_bytes = FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes

    def read_checked(reader, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:
            raise ValueError(f"{reader.path}: per-rank metadata is never read by megaflow")
        path = (Path(reader.path) / METADATA).resolve()
        if path not in checked:  # another checkpoint read meanwhile: the same rule
            checked[path] = check_dcp_metadata(path.parent)
        metadata = checked[path]
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = reader.load_id
        return metadata

    def load_bytes_weights_only(planner, read_item, value: io.BytesIO) -> None:
        data = value.read()
        torch.load(io.BytesIO(data), weights_only=True)  # raises before the permissive load below sees it
        original_load_bytes(planner, read_item, io.BytesIO(data))

    with _PATCH_LOCK:
        FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes = read_checked, load_bytes_weights_only
        try:
            yield first
        finally:
            FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes = original_read, original_load_bytes
