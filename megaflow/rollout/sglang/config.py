"""How to start and drive one SGLang engine (``SGLangEngineConfig``), and the one mapping from megaflow's
config to it (``engine_config``); imports no sglang."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from megaflow.checksum import ALGORITHMS, DEFAULT
from megaflow.config.schema import MegaflowConfig
from megaflow.families import DEFAULT_FAMILY, family_names

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(kw_only=True)
class SGLangEngineConfig:
    """How to start and drive one engine."""

    model_path: str
    """Diffusers pipeline directory (model_index.json + component folders)."""
    family: str = DEFAULT_FAMILY
    """Model family (``megaflow.families``); its card's ``sglang_model_id`` selects SGLang's native pipeline."""
    engine_id: str = "sglang0"
    precision: str = "fp32"
    """Precision of DiT, VAE and text encoders ('fp32' | 'bf16' | 'fp16'); fp32 on CPU."""
    merge_requests: bool = True
    """Merge the compatible CFG-free requests of one ``submit`` into batched engine calls."""
    max_batch_outputs: int = 16
    """Most samples per merged call (a single request larger than this still runs whole)."""
    num_inflight_calls: int = 2
    """Engine calls submitted concurrently (the worker runs one; the next is queued behind it)."""
    log_level: str = "warning"
    """SGLang's log level in the engine processes ('info' shows per-stage timings of every call)."""
    log_dir: str | None = None
    """Write the worker processes' output (SGLang's logging, warnings, progress bars) to
    ``<log_dir>/<engine_id>.log``, appended across restarts; None: they print to this process's terminal."""
    log_requests: bool = False
    """Let SGLang log each request, with per-stage timings, to its log (off: quiet)."""
    call_timeout_s: int = 600
    """A call without an answer for this long counts as an engine crash."""
    max_restarts: int = 3
    """Restarts after crashes before the engine gives up."""
    replay_weights_on_restart: bool = True
    """Keep every tensor pushed by update_weights / load_bucket and re-apply it after a restart: a bucket from
    a bridge's staging slot (the shared-memory bridge on CPU) is kept as a view of the slot, no copy; anything else
    as a host copy (one copy per sync into tensors reused across syncs). See ``megaflow.rollout.sglang.replay``."""
    num_threads: int | None = None
    """Torch threads per worker, passed as ``OMP_NUM_THREADS`` at spawn; None: inherited, else SGLang's choice
    (oversubscribes small CPU hosts, see docs/design/rollout.md)."""
    checksum: str = DEFAULT
    """How the engine's workers hash the tensors they hold for verification (``megaflow.checksum``:
    xxh3 or sha256), told to them when they are spawned; the bridge's ``bridge.checksum``."""
    device_index: int | None = None
    """Local GPU the worker processes are pinned to: they are started with CUDA_VISIBLE_DEVICES naming only
    that device (the entry at this index of this process's CUDA_VISIBLE_DEVICES when set); None: inherit."""
    server_kwargs: dict = field(default_factory=dict)
    """Extra sglang ServerArgs kwargs (expert escape hatch, e.g. {'num_gpus': 2})."""

    def __post_init__(self):
        if self.family not in family_names():
            raise ValueError(f"family must be one of {sorted(family_names())}, got {self.family!r}")
        if self.precision not in DTYPES:
            raise ValueError(f"precision must be one of {sorted(DTYPES)}, got {self.precision!r}")
        if self.checksum not in ALGORITHMS:
            raise ValueError(f"checksum must be one of {', '.join(ALGORITHMS)}, got {self.checksum!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 or None, got {self.num_threads}")
        if self.max_batch_outputs < 1 or self.num_inflight_calls < 1:
            raise ValueError(f"max_batch_outputs and num_inflight_calls must be >= 1, got "
                             f"{self.max_batch_outputs}, {self.num_inflight_calls}")


def engine_config(cfg: MegaflowConfig, model_path: str, engine_id: str, *, device_index: int | None = None,
                  verbose: bool = False) -> SGLangEngineConfig:
    """Settings of engine ``engine_id`` serving ``model_path``, pinned to local GPU ``device_index`` (None: not pinned);
    logs in ``<run dir>/logs/<engine_id>.log``, or the terminal with ``verbose``."""
    r = cfg.rollout
    log_dir = None if verbose else str(Path(cfg.run.output_dir) / cfg.run.name / "logs")
    return SGLangEngineConfig(model_path=str(model_path), family=cfg.model.family, engine_id=engine_id,
                              device_index=device_index, precision=r.precision, max_batch_outputs=r.max_batch_outputs,
                              log_level="info", log_dir=log_dir,
                              checksum=cfg.bridge.checksum,
                              num_threads=r.engine_threads or cfg.run.num_threads,
                              server_kwargs={} if r.attention_backend == "auto" else
                              {"attention_backend": r.attention_backend})
