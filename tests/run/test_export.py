"""`megaflow export`: a run's checkpoint as a diffusers pipeline.

Needs: CPU. The run is made by hand: a tiny SD3 pipeline as the run's ``tiny-pipeline``, its
config.toml, and checkpoint 3 saved from the run's Trainer (built in one gloo rank) after its
weights were moved by 2 Adam steps. Checks: diffusers' StableDiffusion3Pipeline loads the export and
its transformer equals the trainer's weights bit for bit, every other file is byte-identical; an
SGLang engine on the ORIGINAL pipeline with those weights pushed through the shared-memory bridge and an
engine on the EXPORTED pipeline give identical samples (same requests and seeds; tolerance 0, bit
for bit). A FLUX run (weights moved by seeded noise, model-only checkpoint) loads in FluxPipeline the
same way. The bad-input cases exit 2 with one line, before any checkpoint is read, and write nothing.
"""
from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
import torch

from megaflow import cli
from megaflow.config import load_config, save_config
from megaflow.trainer.manifest import write_manifest

ITERATION = 3


def _export(capsys, *argv) -> tuple[int, list[str], str]:
    """(exit code, the ``megaflow: error`` lines, stdout)."""
    rc = cli.main(["export", *map(str, argv)])
    out = capsys.readouterr()
    return rc, [x for x in out.err.splitlines() if x.startswith("megaflow:")], out.out


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run dir, the engine-named weights of checkpoint 3)."""
    from megaflow.models.tiny_pipeline import make_tiny_pipeline
    from megaflow.testing.dist import run_multiprocess

    import export_workers

    run_dir = tmp_path_factory.mktemp("runs") / "tiny"
    pipeline = make_tiny_pipeline("sd3", run_dir / "tiny-pipeline", seed=0)
    save_config(load_config(None, ["train.lr=1e-3"]), run_dir)
    [weights] = run_multiprocess(export_workers.train_and_checkpoint, 1, str(run_dir), str(pipeline), ITERATION,
                                 2, timeout_s=600)
    return run_dir, weights


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    run_dir, _ = run
    out = tmp_path_factory.mktemp("export") / "pipeline"
    (run_dir / "eval.jsonl").write_text('{"iteration": 0, "when": "before", "eval/reward_total": 0.25}\n'
                                        '{"iteration": 3, "when": "after", "eval/reward_total": 0.5}\n'
                                        '{"iteration": 9, "when": "after", "eval/reward_total": 0.9}\n')
    rc = cli.main(["export", "--run", str(run_dir), "--out", str(out), "--json"])
    assert rc == 0
    return out


@pytest.mark.slow
@pytest.mark.dist
def test_export_loads_in_diffusers_with_the_trained_weights(run, exported):
    from diffusers import StableDiffusion3Pipeline

    run_dir, weights = run
    original = run_dir / "tiny-pipeline"
    assert sorted(p.name for p in exported.parent.iterdir()) == ["pipeline"]  # no temp dir left
    pipe = StableDiffusion3Pipeline.from_pretrained(exported)
    got = pipe.transformer.state_dict()
    assert sorted(got) == sorted(weights)
    assert [k for k in weights if not torch.equal(got[k], weights[k])] == []
    before = StableDiffusion3Pipeline.from_pretrained(original).transformer.state_dict()
    moved = [k for k in weights if not torch.equal(before[k], weights[k])]
    assert len(moved) >= 0.9 * len(weights), sorted(set(weights) - set(moved))  # training moved the weights

    # Every other file is the original's, byte for byte, but its own card (README.md) and recipe; the transformer
    # has one new weights file; the card is the run's: base model, algorithm, the evaluations up to the checkpoint.
    weights_file = "transformer/diffusion_pytorch_model.safetensors"
    assert set(_files(exported)) == (set(_files(original)) - {"README.md", "RECIPE.md"}) | {"README.md"}
    others = [f for f in _files(original) if f not in (weights_file, "README.md", "RECIPE.md")]
    card = (exported / "README.md").read_text()
    assert card.startswith("---\n") and "base_model: tiny-pipeline" in card and "library_name: diffusers" in card
    assert "`flowgrpo`" in card and "checkpoint iteration 3 of" in card, card
    assert "| 0 | 0.25 |" in card and "| 3 | 0.5 |" in card and "0.9" not in card, card  # not past iteration 3
    assert "model_index.json" in others and "transformer/config.json" in others
    _, mismatch, errors = filecmp.cmpfiles(original, exported, others, shallow=False)
    assert (mismatch, errors) == ([], [])


@pytest.mark.slow
@pytest.mark.dist
def test_flux_export_loads_in_diffusers_with_the_run_weights(tmp_path, capsys):
    from diffusers import FluxPipeline

    from megaflow.models.tiny_pipeline import make_tiny_pipeline
    from megaflow.testing.dist import run_multiprocess

    import export_workers

    run_dir, out = tmp_path / "flux-run", tmp_path / "flux-export"
    pipeline = make_tiny_pipeline("flux", run_dir / "tiny-pipeline", seed=0)
    save_config(load_config(None, ['model.family="flux"']), run_dir)
    out.mkdir()  # an empty --out is taken
    [weights] = run_multiprocess(export_workers.perturb_and_checkpoint, 1, str(run_dir), str(pipeline), 5, 0.01,
                                 timeout_s=600)
    rc, err, printed = _export(capsys, "--run", run_dir, "--out", out, "--json")
    assert (rc, err) == (0, []) and json.loads(printed)["family"] == "flux"
    got = FluxPipeline.from_pretrained(out).transformer.state_dict()
    assert sorted(got) == sorted(weights)
    assert [k for k in weights if not torch.equal(got[k], weights[k])] == []
    before = FluxPipeline.from_pretrained(pipeline).transformer.state_dict()
    assert all(not torch.equal(before[k], weights[k]) for k in weights)


@pytest.mark.slow
@pytest.mark.dist
def test_export_refuses_what_does_not_fit(run, tmp_path, capsys):
    from megaflow.models.tiny_pipeline import make_tiny_pipeline

    run_dir, _ = run
    flux_run = tmp_path / "flux-run"
    flux_run.mkdir()
    (flux_run / "checkpoints").symlink_to(run_dir / "checkpoints")  # the SD3 checkpoint
    flux = make_tiny_pipeline("flux", tmp_path / "flux", seed=0)
    cfg = load_config(None, [f'model.pretrained="{flux}"', 'model.family="flux"'])
    save_config(cfg, flux_run)
    rc, err, _ = _export(capsys, "--run", flux_run, "--out", tmp_path / "out")
    assert rc == 2 and len(err) == 1 and "SD3Transformer2DModel" in err[0] and "FluxTransformer2DModel" in err[0]
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_bad_input_one_line_exit_2(tmp_path, capsys):
    """Checked before anything heavy: the checkpoint here is only the layout, not a loadable one."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    rc, err, _ = _export(capsys, "--run", run_dir, "--out", out)
    assert rc == 2 and len(err) == 1 and "no such directory" in err[0] and str(run_dir) in err[0]

    run_dir.mkdir()
    rc, err, _ = _export(capsys, "--run", run_dir, "--out", out)
    assert rc == 2 and len(err) == 1 and "config.toml not found" in err[0]

    save_config(load_config(None, [f'model.pretrained="{tmp_path / "nope"}"']), run_dir)
    rc, err, _ = _export(capsys, "--run", run_dir, "--out", out)
    assert rc == 2 and len(err) == 1 and "model.pretrained" in err[0] and "nope" in err[0]

    pipeline = tmp_path / "pipe"
    (pipeline / "transformer").mkdir(parents=True)
    (pipeline / "model_index.json").write_text("{}")
    (pipeline / "transformer" / "config.json").write_text("{}")
    save_config(load_config(None, [f'model.pretrained="{pipeline}"']), run_dir)
    rc, err, _ = _export(capsys, "--run", run_dir, "--out", out)
    assert rc == 2 and len(err) == 1 and "no checkpoints" in err[0]

    ckpt = run_dir / "checkpoints" / "iter_000003"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "state.json").write_text(json.dumps({"iteration": 3}))
    rc, err, _ = _export(capsys, "--run", run_dir, "--iteration", 7, "--out", out)
    assert rc == 2 and len(err) == 1 and "no checkpoint of iteration 7 (have [3])" in err[0]

    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, err, _ = _export(capsys, "--run", run_dir, "--iteration", 3, "--out", out)
    assert rc == 2 and len(err) == 1 and "refusing to overwrite" in err[0] and str(out) in err[0]
    assert _files(out) == ["keep.txt"] and sorted(p.name for p in tmp_path.iterdir()) == ["out", "pipe", "run"]

    rc, err, _ = _export(capsys, "--run", run_dir, "--out", tmp_path / "new")  # no manifest: an older megaflow's
    assert rc == 2 and len(err) == 1 and str(ckpt / "MANIFEST.json") in err[0] and "--trust-checkpoint" in err[0]
    write_manifest(ckpt)
    (ckpt / "state.json").write_text(json.dumps({"iteration": 4}))
    rc, err, _ = _export(capsys, "--run", run_dir, "--out", tmp_path / "new", "--trust-checkpoint")
    assert rc == 2 and len(err) == 1 and str(ckpt / "state.json") in err[0] and "differ" in err[0]
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.engine
def test_exported_samples_equal_the_engines_at_the_same_weights(run, exported):
    """Engine A: the original pipeline + the trained weights through the bridge (as the controller's
    sync_weights does); engine B: the exported pipeline. Same requests and seeds -> equal samples."""
    from megaflow.bridge.shared_memory import SharedMemoryBridge
    from megaflow.rollout.sglang.config import engine_config
    from megaflow.rollout.sglang import SGLangEngine
    from megaflow.rollout.types import RolloutRequest

    run_dir, weights = run
    cfg = load_config(run_dir / "config.toml")

    def requests():
        return [RolloutRequest(prompt="a red circle above a blue square", num_outputs=2, seed=11, num_steps=4,
                               request_id="sde"),
                RolloutRequest(prompt="two green triangles", seeds=[3], num_steps=4, sde_type="ode",
                               request_id="ode")]

    def sample(pipeline: Path, push: bool) -> list:
        engine = SGLangEngine(engine_config(cfg, str(pipeline), "engine0"))
        try:
            before = engine.generate(requests()) if push else None
            if push:
                assert SharedMemoryBridge([engine]).push(iter(weights.items())).verified
            return before, engine.generate(requests())
        finally:
            engine.shutdown()

    torch.set_num_threads(1)
    original, synced = sample(run_dir / "tiny-pipeline", push=True)
    _, from_export = sample(exported, push=False)
    assert [(t.request_id, t.seed) for t in synced] == [(t.request_id, t.seed) for t in from_export]
    for a, b, o in zip(synced, from_export, original):
        assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
        assert torch.equal(a.image, b.image)
        assert not torch.equal(a.image, o.image)  # the comparison can fail: the weights change the samples
