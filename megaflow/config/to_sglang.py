"""The ONE mapping from megaflow's config to SGLang engine settings (SGLangEngineConfig)."""
from __future__ import annotations

from pathlib import Path

from megaflow.config.schema import MegaflowConfig


def engine_config(cfg: MegaflowConfig, model_path: str, engine_id: str, *, device_index: int | None = None,
                  verbose: bool = False):
    """Settings of engine ``engine_id`` serving the pipeline at ``model_path``, its workers pinned to local GPU
    ``device_index`` (None: not pinned). SGLang logs at level info
    (per-stage timings of every call) into ``<run dir>/logs/<engine_id>.log``; ``verbose`` (the CLI's
    ``--verbose``, not a run setting) sends the same output to the terminal instead."""
    from megaflow.rollout.sglang import SGLangEngineConfig
    r = cfg.rollout
    log_dir = None if verbose else str(Path(cfg.run.output_dir) / cfg.run.name / "logs")
    return SGLangEngineConfig(model_path=str(model_path), family=cfg.model.family, engine_id=engine_id,
                              device_index=device_index, precision=r.precision, max_batch_outputs=r.max_batch_outputs,
                              batch_window_ms=r.batch_window_ms, log_level="info", log_dir=log_dir)
