"""A run's rollout settings reach the SGLang engine's server arguments (``engine_config`` -> ``_server_kwargs``)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from megaflow.config import load_config
from megaflow.rollout.sglang.config import engine_config
from megaflow.rollout.sglang.engine import SGLangEngine

DEMO = Path(__file__).resolve().parents[2] / "configs" / "cpu_demo.toml"


def _server_kwargs(sets: list[str]) -> dict:
    config = engine_config(load_config(DEMO, sets), "pipe", "engine0")
    return SGLangEngine._server_kwargs(SimpleNamespace(config=config))


def test_attention_backend_is_sglangs_choice_unless_set():
    assert "attention_backend" not in _server_kwargs([])  # auto: SGLang picks (FlashAttention on CUDA)
    kwargs = _server_kwargs(["rollout.attention_backend=torch_sdpa", "rollout.precision=bf16",
                             "model.dtype=bfloat16"])
    assert kwargs["attention_backend"] == "torch_sdpa" and kwargs["dit_precision"] == "bf16"
    assert kwargs["model_path"] == "pipe" and kwargs["num_gpus"] == 1
