"""What this machine offers a run, told with the standard library only (no torch import)."""
from __future__ import annotations

import os
from pathlib import Path


def cuda_available() -> bool:
    """Whether torch would see a GPU here, told without importing torch: a GPU device node or driver entry
    exists (NVIDIA ``/dev/nvidia0``... or ``/proc/driver/nvidia/gpus/*``; WSL2 ``/dev/dxg``; ROCm
    ``/dev/kfd``) and ``CUDA_VISIBLE_DEVICES`` does not hide every device (empty, or starting with ``-``)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and (not visible.strip() or visible.strip().startswith("-")):
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    return (any(Path("/dev").glob("nvidia[0-9]*")) or (gpus.is_dir() and any(gpus.iterdir()))
            or Path("/dev/dxg").exists() or Path("/dev/kfd").exists())
