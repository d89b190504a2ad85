"""No code from a model directory (megaflow.config.remote_code): a pipeline whose text encoder's config has an
``auto_map``, whose model_index.json names a custom component or pipeline class, is refused with one line naming
the file by the preflight and by every loader of a model directory (the run, the SGLang engine and its workers'
text encoder loader, diffusers' pipeline samplers, pretrain, export); each payload would write a marker file when
imported, and no marker appears. ``--trust-remote-code`` lifts the refusal: the diffusers sampler then imports the
payload (the marker appears) and samples with it. The command-level rows (train, demo, pretrain, eval shapes,
convert_checkpoint) are in test_malformed_inputs.py. Needs: CPU, 1 process; torch, diffusers and sglang imports
(~20 s; the trusted eval subprocess is slow)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from malformed_builders import (  # tests/config/malformed_builders.py
    MARKER, REPO, SHIPPED, TRAIN, add_remote_code, fake_pipeline,
)
from megaflow.cli import build_parser
from megaflow.cli.common import load_checked
from megaflow.config import load_config
from megaflow.config.preflight import preflight
from megaflow.config.remote_code import custom_components, find_remote_code, refuse_remote_code

KINDS = {  # kind, folder -> the file the refusal names, relative to the pipeline, and words of its reason
    ("auto_map", "text_encoder"): ("text_encoder/config.json", "auto_map"),
    ("auto_map", "tokenizer_3"): ("tokenizer_3/config.json", "auto_map"),
    ("component", "text_encoder_2"): ("text_encoder_2/payload.py", "custom component class ['payload', "
                                      "'PayloadModel'] for 'text_encoder_2'"),
    ("pipeline", ""): ("model_index.json", "custom pipeline class ['payload', 'PayloadModel'] (from payload.py)"),
}


def _remote(tmp: Path, kind: str = "auto_map", folder: str = "text_encoder", **kw) -> Path:
    return add_remote_code(fake_pipeline(tmp / "pipe"), kind, marker=tmp / MARKER, folder=folder, **kw)


def _refused(tmp: Path, call, needle: str) -> str:
    """``call()`` raises one line holding ``needle`` and the payload never ran."""
    with pytest.raises(ValueError) as e:
        call()
    line = str(e.value)
    assert "\n" not in line and needle in line, line
    assert not (tmp / MARKER).exists(), "the payload ran"
    return line


@pytest.mark.parametrize("kind, folder", sorted(KINDS))
def test_each_kind_of_code_is_found_and_refused(tmp_path, kind, folder):
    pipe = _remote(tmp_path, kind, folder)
    file, why = KINDS[kind, folder]
    found = find_remote_code(pipe)
    assert found is not None and found[0] == pipe / file and why in found[1], found
    line = _refused(tmp_path, lambda: refuse_remote_code(pipe, "model.pretrained"), f"model.pretrained: {pipe / file}: ")
    assert line.endswith("code in a model directory runs only with --trust-remote-code")
    refuse_remote_code(pipe, "model.pretrained", trust=True)  # trusted: no refusal


def test_tokenizer_config_auto_map_and_a_component_without_its_module(tmp_path):
    pipe = fake_pipeline(tmp_path / "pipe")
    (pipe / "tokenizer").mkdir()
    (pipe / "tokenizer" / "tokenizer_config.json").write_text('{"auto_map": {"AutoTokenizer": ["tok.T", null]}}')
    assert find_remote_code(pipe) is None  # not a component of model_index.json: no loader reads it
    index = (pipe / "model_index.json").read_text().replace('"vae":', '"tokenizer": ["transformers", "CLIPTokenizer"], '
                                                                      '"vae":')
    (pipe / "model_index.json").write_text(index)
    assert find_remote_code(pipe) == (pipe / "tokenizer" / "tokenizer_config.json",
                                      'auto_map {"AutoTokenizer": ["tok.T", null]} names code to import')
    (pipe / "model_index.json").write_text(index.replace('"transformers", "CLIPTokenizer"', '"os", "system"'))
    assert custom_components(pipe) == [("tokenizer", pipe / "model_index.json", "custom component class ['os', "
                                        "'system'] for 'tokenizer' (not from diffusers or transformers)")]


def test_real_pipelines_hold_no_code(tiny_sd3_dir, tmp_path):
    assert find_remote_code(SHIPPED) is None and custom_components(SHIPPED) == []
    assert find_remote_code(tiny_sd3_dir) is None and custom_components(tiny_sd3_dir) == []
    assert find_remote_code(tmp_path / "nowhere") is None  # the file checks name a missing directory


def _cfg(pipe: Path, *extra: str):
    return load_config(TRAIN[2], [f'model.pretrained="{pipe}"', f'run.output_dir="{pipe.parent / "runs"}"', *extra])


def test_preflight_refuses_unless_trusted_and_the_flag_sets_it(tmp_path):
    pipe = _remote(tmp_path)
    _refused(tmp_path, lambda: preflight(_cfg(pipe), "train"), f"model.pretrained: {pipe}/text_encoder/config.json")
    assert preflight(_cfg(pipe), "show").model.trust_remote_code is False  # show loads nothing
    assert preflight(_cfg(pipe, "model.trust_remote_code=true"), "train").model.trust_remote_code
    for command in ("train", "demo", "pretrain"):
        args = build_parser().parse_args([command, "-c", TRAIN[2], "--trust-remote-code", "--set",
                                          f'run.output_dir="{tmp_path / "runs"}"', "--set",
                                          f'model.pretrained="{SHIPPED}"'])
        assert args.trust_remote_code and load_checked(args, command).model.trust_remote_code
    args = build_parser().parse_args(["train", "-c", TRAIN[2]])
    assert not load_checked(args, "train").model.trust_remote_code
    assert not (tmp_path / MARKER).exists()


def test_the_run_refuses_before_the_trainer_and_engines_load(tmp_path):
    from megaflow.run.build import resolve_pipeline
    pipe = _remote(tmp_path, "component")
    _refused(tmp_path, lambda: resolve_pipeline(_cfg(pipe), tmp_path / "runs" / "r"),
             f"model.pretrained: {pipe}/text_encoder/payload.py: custom component class")
    assert resolve_pipeline(_cfg(pipe, "model.trust_remote_code=true"), tmp_path / "runs" / "r") == pipe


class _Warm:
    """A stand-in warm worker: records that the engine discarded it."""
    discarded = False

    def discard(self):
        self.discarded = True


def test_the_engine_refuses_before_any_worker_starts(tmp_path):
    from megaflow.rollout.sglang import SGLangEngine, SGLangEngineConfig
    from megaflow.rollout.sglang.config import engine_config
    pipe, warm = _remote(tmp_path), _Warm()
    _refused(tmp_path, lambda: SGLangEngine(SGLangEngineConfig(model_path=str(pipe)), warm=warm),
             f"the engine's model directory: {pipe}/text_encoder/config.json: auto_map")
    assert warm.discarded
    assert engine_config(_cfg(pipe, "model.trust_remote_code=true"), str(pipe), "e0").trust_remote_code
    engine = SimpleNamespace(config=SGLangEngineConfig(model_path=str(pipe)))
    assert SGLangEngine._server_kwargs(engine)["trust_remote_code"] is False  # SGLang is told, not left to defaults
    custom = _remote(tmp_path / "c", "component")  # trusted, but SGLang's native pipeline cannot load it
    line = _refused(tmp_path / "c", lambda: SGLangEngine(SGLangEngineConfig(model_path=str(custom),
                                                                            trust_remote_code=True)),
                    f"{custom}/text_encoder/payload.py: custom component class ['payload', 'PayloadModel'] for "
                    "'text_encoder'")
    assert "the SGLang engine cannot load it (its native pipelines load diffusers and transformers classes only)" \
        in line


def test_the_workers_text_encoder_loader_is_guarded(tmp_path):
    import importlib

    from megaflow.rollout.sglang import plugin
    module, cls, method = plugin.ENCODER_CONFIG_TARGET.rsplit(".", 2)
    assert callable(getattr(getattr(importlib.import_module(module), cls), method))  # the hooked target exists
    pipe, calls = _remote(tmp_path), []

    def original(loader, path, model_config, server_args, name):
        calls.append(path)
        return "config"

    class Args:
        trust_remote_code = False

    folder = str(pipe / "text_encoder")
    _refused(tmp_path, lambda: plugin.untrusted_encoder_config(original, None, folder, {}, Args(), "text_encoder"),
             f"text encoder: {folder}/config.json: auto_map")
    Args.trust_remote_code = True
    assert plugin.untrusted_encoder_config(original, None, folder, {}, Args(), "text_encoder") == "config"
    assert calls == [folder]


def test_the_diffusers_samplers_refuse(tmp_path):
    from megaflow.rollout.baseline import DiffusersEngine
    from megaflow.rollout.pipeline_sampler import PipelineSampler
    from megaflow.shapeeval.evaluate import evaluate_pipeline
    pipe = _remote(tmp_path, "component")
    needle = f"pipeline: {pipe}/text_encoder/payload.py: custom component class"
    _refused(tmp_path, lambda: PipelineSampler.from_pretrained(str(pipe)), needle)
    _refused(tmp_path, lambda: DiffusersEngine.from_pretrained(str(pipe)), needle)
    _refused(tmp_path, lambda: evaluate_pipeline(pipe, sampler="diffusers"), needle)
    _refused(tmp_path, lambda: evaluate_pipeline(pipe, sampler="sglang"), "the engine's model directory: ")


def test_pretrain_and_export_refuse(tmp_path):
    from megaflow.commands.export import export_run
    from megaflow.models.sd3 import shapes as kit
    from megaflow.pretrain.loop import load_parts
    pipe = _remote(tmp_path, "pipeline")
    _refused(tmp_path, lambda: load_parts(kit, pipe), f"pretrain.init_from: {pipe}/model_index.json: custom pipeline")
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "config.toml").write_text(f'[model]\npretrained = "{pipe}"\n')
    _refused(tmp_path, lambda: export_run(run, tmp_path / "out"), f"--run {run}: pipeline: {pipe}/model_index.json")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="no checkpoint"):  # trusted: on to the next check
        export_run(run, tmp_path / "out", trust_remote_code=True)


@pytest.mark.slow
def test_trusted_eval_runs_the_payload_and_samples(tiny_sd3_dir, tmp_path):
    """``eval shapes --sampler diffusers --trust-remote-code`` on a pipeline whose text encoder is a custom class
    (a CLIPTextModelWithProjection subclass in text_encoder/payload.py): diffusers imports the payload (the marker
    appears) and the evaluation runs; without the flag the same command is refused and the marker stays away."""
    pipe = tmp_path / "pipe"
    shutil.copytree(tiny_sd3_dir, pipe)
    add_remote_code(pipe, "component", marker=tmp_path / MARKER, base="transformers.CLIPTextModelWithProjection")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "HF_MODULES_CACHE": str(tmp_path / "modules")}  # diffusers copies the module there
    argv = [sys.executable, "-m", "megaflow.cli", "eval", "shapes", "--pipeline", str(pipe), "--sampler", "diffusers",
            "--num", "2", "--num-seen", "0", "--steps", "2", "--out", str(tmp_path / "images"), "--json"]
    refused = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "--trust-remote-code" in refused.stderr, refused.stderr[-2000:]
    assert not (tmp_path / MARKER).exists()
    trusted = subprocess.run([*argv, "--trust-remote-code"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=300)
    assert trusted.returncode == 0, trusted.stderr[-2000:]
    assert (tmp_path / MARKER).read_text() == "ran"
    assert '"sampler": "diffusers"' in trusted.stdout


@pytest.mark.slow
@pytest.mark.engine
def test_the_workers_refuse_what_the_host_check_missed(tiny_sd3_dir, tmp_path, monkeypatch):
    """With the host's check bypassed, the worker's own guard (megaflow's SGLang plugin around the text encoder
    loader, which asks transformers' AutoConfig with remote code trusted whatever the server args say: without the
    guard this payload runs) refuses the text encoder's auto_map; SGLang falls back to its native load under the
    server args' trust_remote_code = False, which ignores the auto_map. The payload never runs."""
    from megaflow.rollout.sglang import SGLangEngine, SGLangEngineConfig
    from megaflow.rollout.sglang import engine as engine_module
    pipe = tmp_path / "pipe"
    shutil.copytree(tiny_sd3_dir, pipe)
    add_remote_code(pipe, "auto_map", marker=tmp_path / MARKER, folder="text_encoder")
    monkeypatch.setattr(engine_module, "check_model_dir", lambda config: None)
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))  # where transformers would copy the payload
    engine = SGLangEngine(SGLangEngineConfig(model_path=str(pipe), num_threads=1, log_dir=str(tmp_path / "logs")))
    try:
        assert not (tmp_path / MARKER).exists(), "the payload ran in the worker"
        log = (tmp_path / "logs" / "sglang0.log").read_text()
        assert f"text encoder: {pipe}/text_encoder/config.json: auto_map" in log, log[-3000:]
    finally:
        engine.shutdown()
