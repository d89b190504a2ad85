"""The ONE mapping from megaflow's config to SGLang engine settings (SGLangEngineConfig)."""
from __future__ import annotations

from megaflow.config.schema import MegaflowConfig


def engine_config(cfg: MegaflowConfig, model_path: str, engine_index: int):
    """Settings of engine ``engine_index`` serving the pipeline at ``model_path``."""
    from megaflow.rollout.sglang_engine import SGLangEngineConfig
    r = cfg.rollout
    return SGLangEngineConfig(model_path=str(model_path), family=cfg.model.family, engine_id=f"engine{engine_index}",
                              precision=r.precision, max_batch_outputs=r.max_batch_outputs,
                              batch_window_ms=r.batch_window_ms)
