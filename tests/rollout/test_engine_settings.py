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


def test_each_card_selects_sglangs_native_pipeline_by_its_model_id():
    """``sglang_model_id`` resolves in SGLang's registry by its exact short name (no fallback to detection by the
    model path): Qwen-Image's selects Qwen/Qwen-Image's own configs (not 2512's, whose default negative prompt
    differs, nor an edit variant's)."""
    from megaflow.families import card, family_names
    from sglang.multimodal_gen.registry import _get_config_info, _MODEL_HF_PATH_TO_NAME, get_model_short_name

    shorts = {get_model_short_name(p).lower() for p in _MODEL_HF_PATH_TO_NAME}
    for name in family_names():
        model_id = card(name).sglang_model_id
        assert model_id.lower() in shorts, (name, model_id)
        assert _get_config_info("not-a-model-path", model_id=model_id) is not None, name
    info = _get_config_info("not-a-model-path", model_id=card("qwen_image").sglang_model_id)
    assert (info.pipeline_config_cls.__name__, info.sampling_param_cls.__name__) == (
        "QwenImagePipelineConfig", "QwenImageSamplingParams")
