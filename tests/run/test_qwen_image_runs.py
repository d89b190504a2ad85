"""Qwen-Image end to end: `megaflow train` on configs/cpu_demo_qwen_image.toml made tiny (32x32, 3 steps, 2 prompts x
3 samples, 3 iterations, a checkpoint every iteration) with each algorithm, SGLang's own Qwen-Image pipeline
sampling, the megatron trainer, the bridge; then the disaggregated placement, a kill -9 + resume and `megaflow export`.

One run per algorithm (module fixture) is shared by the tests: FlowGRPO with the config's true CFG (4.0, SDE),
DiffusionNFT, AWM (with LoRA adapters: only they sync) and DGPO (through the disk bridge), the last three ODE
without CFG. Checks: every iteration trains and its sync verifies by checksum; FlowGRPO's recomputed log-probs equal
the engine's (<= 1e-5); the same FlowGRPO run with the engine on its own rank (2 ranks, the distributed bridge)
gives the same rewards and losses (1e-6 relative, the same computation on the same CPU); SIGKILLed right after
iteration 2's update and resumed, it ends with the uninterrupted run's weights and rewards bit for bit
(torch.equal); its export is a QwenImagePipeline that plain diffusers loads (its transformer = the checkpoint's
weights through the family's weight map, bit for bit) and samples from.
Needs: CPU, real SGLang engines (one per run, ~20-50 s each), gloo (2 ranks once); slow.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from megaflow.rundir.checkpoints import list_checkpoints

from resume_harness import Launch

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.dist]
REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "cpu_demo_qwen_image.toml"
TINY = ("rollout.prompts_per_iter=2", "rollout.group_size=3", "rollout.num_steps=3", "train.micro_batch_size=3",
        "train.iterations=3", "train.save_every=1", "train.keep_checkpoints=3")
ODE = ("rollout.sde_type=ode", "rollout.guidance_scale=1.0")
SETTINGS = {"flowgrpo": (), "nft": ("algo.name=nft", *ODE),
            "awm": ("algo.name=awm", *ODE, "lora.rank=4", "lora.alpha=8.0"),
            "dgpo": ("algo.name=dgpo", *ODE, "bridge.mode=disk")}
DISAGGREGATED = ("rollout.placement=disaggregated", "rollout.engine_ranks=1", "bridge.mode=distributed")
COMPARED = ("reward/total", "train/loss", "train/approx_kl", "train/grad_norm", "train/logp_abs_diff_rollout")


def _launch(out: Path, name: str, *sets: str, nproc: int = 1, resume: bool = False, fault: str = "") -> Path:
    extra = tuple(x for s in (f'run.output_dir="{out}"', f'run.name="{name}"', *TINY, *sets) for x in ("--set", s))
    rc, _, err = Launch(CONFIG, nproc=nproc, resume=resume, fault=fault, extra=extra).wait(timeout=900)
    assert (rc == 0) != bool(fault), (rc, err[-3000:])
    return out / name


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from megaflow.trainer.checkpoint import load_full_state_dict
    it, ckpt = list_checkpoints(run_dir)[-1]
    assert it == 3
    return {k: v for k, v in load_full_state_dict(ckpt / "model")[1].items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("qwen")
    return {algo: _launch(out, algo, *sets) for algo, sets in SETTINGS.items()}


def test_every_algorithm_trains_and_syncs(runs):
    for algo, run_dir in runs.items():
        rows = _rows(run_dir)
        assert [r["iteration"] for r in rows] == [0, 1, 2, 3], algo
        for r in rows[1:]:
            assert r["train/update_ok"] == 1.0 and r["train/grad_norm"] > 0, (algo, r)
            assert r["sync/verified"] == 1.0 and r["sync/tensors"] > 0, (algo, r)
            assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), (algo, r)
    grpo = _rows(runs["flowgrpo"])[1:]
    assert all(r["train/logp_abs_diff_rollout"] <= 1e-5 for r in grpo), [r["train/logp_abs_diff_rollout"] for r in grpo]
    assert all(0 < r["sync/mbytes"] < grpo[0]["sync/mbytes"] for r in _rows(runs["awm"])[1:])  # adapters only


def test_disaggregated_flowgrpo_equals_colocated(runs, tmp_path):
    dis = _rows(_launch(tmp_path, "disaggregated", *DISAGGREGATED, nproc=2))
    one = _rows(runs["flowgrpo"])
    assert [r["iteration"] for r in dis] == [r["iteration"] for r in one]
    for rd, ro in zip(dis[1:], one[1:]):
        assert rd["sync/verified"] == 1.0 and rd["rollout/host1/images"] == ro["rollout/host0/images"] > 0
        for key in COMPARED:
            assert rd[key] == pytest.approx(ro[key], rel=1e-6, abs=1e-12), (rd["iteration"], key)


def test_kill9_after_the_update_resumes_exactly(runs, tmp_path):
    _launch(tmp_path, "crashed", fault="train@2")
    crashed = _launch(tmp_path, "crashed", resume=True)
    want, got = _weights(runs["flowgrpo"]), _weights(crashed)
    assert want.keys() == got.keys() and [k for k in want if not torch.equal(want[k], got[k])] == []
    assert [r.get("reward/total") for r in _rows(crashed)] == [r.get("reward/total") for r in _rows(runs["flowgrpo"])]


def test_export_is_a_qwen_image_pipeline_diffusers_samples_from(runs, tmp_path, capsys):
    from diffusers import DiffusionPipeline

    from megaflow import cli
    from megaflow.models.qwen_image import from_diffusers
    from megaflow.models.registry import get_family

    run_dir, out = runs["flowgrpo"], tmp_path / "export"
    assert cli.main(["export", "--run", str(run_dir), "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["family"] == "qwen_image"
    pipe = DiffusionPipeline.from_pretrained(out, torch_dtype=torch.float32)
    assert type(pipe).__name__ == "QwenImagePipeline"
    config = from_diffusers(json.loads((out / "transformer" / "config.json").read_text()))
    want = get_family("qwen_image").weight_map.to_diffusers(_weights(run_dir), config)
    got = pipe.transformer.state_dict()
    assert sorted(got) == sorted(want) and [k for k in want if not torch.equal(got[k], want[k])] == []
    start = DiffusionPipeline.from_pretrained(run_dir / "tiny-pipeline").transformer.state_dict()
    assert any(not torch.equal(start[k], want[k]) for k in want)  # training moved the weights
    images = pipe("a red circle", num_inference_steps=2, height=32, width=32, true_cfg_scale=4.0, negative_prompt="",
                  output_type="pt", generator=torch.Generator().manual_seed(0)).images
    assert images.shape == (1, 3, 32, 32) and torch.isfinite(images).all()
