"""The pickles of a distributed checkpoint are checked before torch unpickles them (megaflow.trainer.dcp_metadata):
torch's own metadata and items pass; a crafted ``.metadata`` is refused in one line naming the global it asks for,
a crafted non-tensor item in a ``.distcp`` file in one line naming the item, and nothing of either runs -- also
through the load path ``megaflow export`` and ``to-diffusers`` use, and even when the manifest is intact. Inside
``reading`` torch reads the metadata that was checked and loads byte items weights_only (a swap after the check
runs nothing). The chunk-cover check is O(n log n) (10**5 chunks: seconds, not hours) and agrees with counting
every element's chunks (chunks out of a grid: pairwise up to MAX_IRREGULAR_CHUNKS, refused beyond). Needs: CPU, 1
process (< 5 s; the 10**5-chunk test, slow: ~20 s, mostly pickling)."""
from __future__ import annotations

import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megaflow.trainer.checkpoint import load_full_state_dict
from megaflow.trainer.dcp_metadata import METADATA, check_dcp_metadata
from megaflow.trainer.manifest import write_manifest


class _RunsCode:
    """Unpickling this runs ``os.system`` (what a crafted checkpoint would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_torch_written_metadata_passes(tmp_path):
    state = {"w": torch.randn(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16), "step": 7,
             "extra": {"lr": 0.1, "names": ["a", "b"]}}
    dcp.save(state, checkpoint_id=str(tmp_path))
    assert (tmp_path / METADATA).is_file()
    check_dcp_metadata(tmp_path)


def _crafted(directory, marker):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / METADATA).write_bytes(pickle.dumps({"state_dict_metadata": _RunsCode(marker)}))
    (directory / "megaflow_model.json").write_text('{"format": 1, "family": "sd3"}')
    write_manifest(directory)  # intact: the manifest guards integrity, not what the pickle asks for
    return directory


def test_a_crafted_metadata_is_refused_naming_the_global_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    ckpt = _crafted(tmp_path / "model", marker)
    with pytest.raises(ValueError) as e:
        check_dcp_metadata(ckpt)
    message = str(e.value)
    assert "\n" not in message and str(ckpt / METADATA) in message and "system" in message
    with pytest.raises(ValueError, match="system"):
        load_full_state_dict(ckpt)
    assert not marker.exists()


def test_a_crafted_item_inside_a_distcp_file_is_refused_and_runs_nothing(tmp_path):
    """The metadata is torch's own; one non-tensor item (a torch.save blob torch's planner would load with
    weights_only=False) asks for os.system."""
    marker = tmp_path / "ran"
    dcp.save({"w": torch.ones(2), "extra": _RunsCode(marker)}, checkpoint_id=str(tmp_path / "ckpt"))
    with pytest.raises(ValueError) as e:
        check_dcp_metadata(tmp_path / "ckpt")
    message = str(e.value)
    assert "\n" not in message and "'extra'" in message and "weights_only" in message and ".distcp" in message
    assert not marker.exists()


def test_garbage_metadata_is_one_line(tmp_path):
    (tmp_path / METADATA).write_bytes(b"\x80\x05not a pickle at all")
    with pytest.raises(ValueError, match="unreadable checkpoint metadata") as e:
        check_dcp_metadata(tmp_path)
    assert "\n" not in str(e.value)


def _edit(directory, edit):
    """Unpickle our own ``.metadata``, ``edit`` it, pickle it back."""
    metadata = pickle.loads((directory / METADATA).read_bytes())  # noqa: S301 - the test's own file
    edit(metadata)
    (directory / METADATA).write_bytes(pickle.dumps(metadata))


def test_chunks_that_cover_a_tensor_twice_or_a_missing_shape_are_refused(tmp_path):
    dcp.save({"w": torch.randn(4, 3)}, checkpoint_id=str(tmp_path))
    check_dcp_metadata(tmp_path, shapes={"w": (4, 3)})
    with pytest.raises(ValueError, match="the model's is \\(4, 4\\)"):
        check_dcp_metadata(tmp_path, shapes={"w": (4, 4)})
    with pytest.raises(ValueError, match="holds no tensor 'b', which the model needs"):
        check_dcp_metadata(tmp_path, shapes={"b": (3,)})
    _edit(tmp_path, lambda m: m.state_dict_metadata["w"].chunks.append(m.state_dict_metadata["w"].chunks[0]))
    with pytest.raises(ValueError, match="do not cover its size") as e:
        check_dcp_metadata(tmp_path)
    assert "\n" not in str(e.value)


def test_inside_reading_torch_gets_the_checked_metadata_and_loads_bytes_weights_only(tmp_path):
    """What torch reads inside ``reading`` is what was checked: a ``.metadata`` swapped for a payload after the
    check is never unpickled (the load still gives the saved values), and a byte item is loaded with
    weights_only first, so a payload in one raises before it runs."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from megaflow.trainer.dcp_metadata import reading

    marker = tmp_path / "ran"
    saved = {"w": torch.randn(4, 3), "step": 7}
    dcp.save(saved, checkpoint_id=str(tmp_path / "ckpt"))
    original = FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes
    with reading(tmp_path / "ckpt"):
        (tmp_path / "ckpt" / METADATA).write_bytes(pickle.dumps(_RunsCode(marker)))
        loaded = {"w": torch.zeros(4, 3), "step": 0}
        dcp.load(loaded, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
        assert torch.equal(loaded["w"], saved["w"]) and loaded["step"] == 7
        blob = io.BytesIO()
        torch.save(_RunsCode(marker), blob)
        with pytest.raises(pickle.UnpicklingError):
            DefaultLoadPlanner().load_bytes(None, io.BytesIO(blob.getvalue()))
    assert not marker.exists()
    assert (FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes) == original  # put back
    with pytest.raises(ValueError, match="posix.system"):  # the next read is checked again
        with reading(tmp_path / "ckpt"):
            pass


def _many_chunks(directory, n: int, *, shift_last: int = 0):
    """A ``.metadata`` of one float32 tensor [2, n] stored as n chunks [2, 1] (a grid along dimension 1, the
    layout the old pairwise check was quadratic on), the last one moved by ``shift_last`` columns."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    directory.mkdir()
    (directory / "data.distcp").write_bytes(bytes(8 * n))
    chunks = [ChunkStorageMetadata(offsets=torch.Size([0, i]), sizes=torch.Size([2, 1])) for i in range(n)]
    chunks[-1] = ChunkStorageMetadata(offsets=torch.Size([0, n - 1 - shift_last]), sizes=torch.Size([2, 1]))
    storage = {MetadataIndex("w", c.offsets): _StorageInfo("data.distcp", 8 * i, 8) for i, c in enumerate(chunks)}
    tensor = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([2, n]), chunks)
    (directory / METADATA).write_bytes(pickle.dumps(Metadata({"w": tensor}, storage_data=storage)))
    return directory


@pytest.mark.slow
def test_a_hundred_thousand_chunks_are_checked_in_n_log_n(tmp_path):
    """10**5 chunks: passed (a grid) or refused (one chunk twice: the grid has a hole and a double) within a
    generous 10 s; the pairwise check took about n**2 / 2 = 5e9 comparisons for both."""
    import time

    grid, twice = _many_chunks(tmp_path / "grid", 10**5), _many_chunks(tmp_path / "twice", 10**5, shift_last=1)
    started = time.perf_counter()
    check_dcp_metadata(grid)
    assert time.perf_counter() - started < 10
    started = time.perf_counter()
    with pytest.raises(ValueError, match="do not cover its size") as e:
        check_dcp_metadata(twice)
    assert time.perf_counter() - started < 10
    assert "\n" not in str(e.value) and str(twice / METADATA) in str(e.value)


def _covered_once(size, boxes) -> bool:
    """The reference: count every element's chunks in an array."""
    import numpy as np
    count = np.zeros(size, dtype=np.int64)
    for off, sz in boxes:
        count[tuple(slice(o, o + s) for o, s in zip(off, sz))] += 1
    return bool((count == 1).all())


def test_the_cover_verdict_matches_counting_every_element():
    """Random chunkings (grids, bricks, overlaps, holes, empty chunks) of small 2-d and 3-d tensors: the chunks'
    volume equal to the tensor's and no overlap (megaflow's verdict) exactly when every element is in one chunk."""
    import math
    import random

    from megaflow.trainer.dcp_metadata import _overlap

    rng = random.Random(0)
    verdicts = set()
    for _ in range(3000):
        size = tuple(rng.randint(1, 4) for _ in range(rng.choice((2, 3))))
        boxes = []
        for _ in range(rng.randint(1, 6)):
            off = tuple(rng.randrange(d) for d in size)
            boxes.append((off, tuple(rng.randint(0, d - o) for o, d in zip(off, size))))
        if rng.random() < 0.3:  # a true grid
            cuts = [sorted({0, d, *rng.sample(range(1, d + 1), rng.randint(0, d))}) for d in size]
            boxes = [(off, sz) for off, sz in _cells(cuts)]
        ours = sum(math.prod(s) for _, s in boxes) == math.prod(size) and not _overlap(boxes)
        assert ours == _covered_once(size, boxes), (size, boxes)
        verdicts.add(ours)
    assert verdicts == {True, False}


def _cells(cuts):
    import itertools
    per_dim = [[(a, b - a) for a, b in zip(c, c[1:])] for c in cuts]
    for cell in itertools.product(*per_dim):
        yield tuple(o for o, _ in cell), tuple(s for _, s in cell)


def _bricks(rows: int, width: int) -> list[tuple[tuple, tuple]]:
    """A tiling of [rows, 2 * width] by bricks of 1 x 2, each odd row shifted by one (halves at its ends): exact,
    but no grid (the column intervals overlap)."""
    boxes = []
    for r in range(rows):
        if r % 2 == 0:
            boxes += [((r, 2 * j), (1, 2)) for j in range(width)]
        else:
            ends = [((r, 0), (1, 1)), ((r, 2 * width - 1), (1, 1))]
            boxes += ends + [((r, 2 * j + 1), (1, 2)) for j in range(width - 1)]
    return boxes


def test_chunks_not_in_a_grid_are_compared_pairwise_up_to_a_bound():
    """A brick tiling is exact (the reference counts every element once) and passes when small; beyond
    MAX_IRREGULAR_CHUNKS chunks out of a grid it is refused rather than compared pair by pair."""
    from megaflow.trainer.dcp_metadata import MAX_IRREGULAR_CHUNKS, _grid, _overlap

    small = _bricks(4, 6)
    assert not _grid(small) and _covered_once((4, 12), small) and not _overlap(small)
    large = _bricks(2, MAX_IRREGULAR_CHUNKS // 2 + 10)
    assert len(large) > MAX_IRREGULAR_CHUNKS and _overlap(large)
