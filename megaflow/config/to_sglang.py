"""The ONE mapping from megaflow's config to SGLang engine settings (SGLangEngineConfig)."""
from __future__ import annotations

from pathlib import Path

from megaflow.config.schema import MegaflowConfig


def engine_config(cfg: MegaflowConfig, model_path: str, engine_index: int, *, verbose: bool = False):
    """Settings of engine ``engine_index`` serving the pipeline at ``model_path``. SGLang logs at level info
    (per-stage timings of every call) into ``<run dir>/logs/engine<i>.log``; ``verbose`` (the CLI's
    ``--verbose``, not a run setting) sends the same output to the terminal instead."""
    from megaflow.rollout.sglang import SGLangEngineConfig
    r = cfg.rollout
    log_dir = None if verbose else str(Path(cfg.run.output_dir) / cfg.run.name / "logs")
    return SGLangEngineConfig(model_path=str(model_path), family=cfg.model.family, engine_id=f"engine{engine_index}",
                              precision=r.precision, max_batch_outputs=r.max_batch_outputs,
                              batch_window_ms=r.batch_window_ms, log_level="info", log_dir=log_dir)
