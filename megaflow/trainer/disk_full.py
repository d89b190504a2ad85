"""A checkpoint write that fails on a full disk, told apart (:func:`disk_full`) and said in one line
(:class:`NoSpace`); torch hides the OS error, so a failure with fewer bytes free than needed counts too.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import shutil
from pathlib import Path

import torch

from megaflow.parallel.distributed import current_device


class NoSpace(OSError):
    """A checkpoint not written for want of disk space: ``str()`` is one line naming where, the bytes needed and
    the bytes free; errno ENOSPC."""

    def __init__(self, dst: Path, needed: int, free: int, where: Path, then: str = ""):
        self.dst, self.needed, self.free, self.where = dst, needed, free, where
        self.message = (f"{dst}: not written, the disk is full: it needs about {needed} bytes "
                        f"({needed / 2**20:.1f} MiB), {free} are free on {where}{then}")
        super().__init__(errno.ENOSPC, self.message)

    def __str__(self) -> str:
        return self.message


def disk_full(error: BaseException, dst: Path, needed: int, *, written: int = 0) -> NoSpace | None:
    """A NoSpace for ``dst`` when ``error`` came from a full disk: an OS error saying so anywhere in its chain, or
    fewer bytes free (the partial files still there, ``written`` of them) than the ``needed`` total."""
    seen, e = set(), error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            break
        e = e.__cause__ or e.__context__
    where = next((p for p in (dst, *dst.parents) if p.exists()), Path("/"))
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return None
    if e is None and free + written >= needed:
        return None
    return NoSpace(dst, needed, free, where)


@contextlib.contextmanager
def writer_failures_raised_not_logged():
    """megatron's file writer logs a failed write (2 lines) and raises it too: keep only the raise."""
    writer = logging.getLogger("megatron.core.dist_checkpointing")
    level = writer.level
    writer.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        writer.setLevel(level)


def tree_bytes(directory: Path) -> int:
    """Bytes of the files under ``directory`` (0 when it is gone)."""
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file()) if directory.is_dir() else 0


def checkpoint_bytes(state: dict) -> int:
    """Bytes the tensors of a sharded state dict take in a checkpoint, summed over the ranks (main replicas)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    local = sum(t.data.numel() * t.data.element_size() for t in nested_values(state)
                if isinstance(t, ShardedTensor) and isinstance(t.data, torch.Tensor) and is_main_replica(t.replica_id))
    total = torch.tensor([local], dtype=torch.float64, device=current_device())
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(total)
    return int(total.item())
