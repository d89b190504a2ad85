"""Wan end to end with every clean-sample algorithm: `megaflow train` on configs/cpu_demo_wan.toml made tiny (5-frame
32x32 clips, 3 ODE steps without CFG, 2 prompts x 2 samples, 3 iterations, a checkpoint every iteration), SGLang's
own Wan pipeline sampling, the megatron trainer, the bridge; then a kill -9 + `--resume auto` and `megaflow export`.
(FlowGRPO on Wan, whose recomputed log-probs are checked against the engine's, is tests/run/test_wan_run.py.)

One run per algorithm (module fixture) is shared by the tests: DiffusionNFT (full parameters, shared-memory bridge),
AWM (LoRA adapters: only they sync) and DGPO (through the disk bridge). Checks: every iteration trains and its sync
verifies by checksum in the engine; SIGKILLed right after iteration 2's update and resumed with `--resume auto`, the
NFT run ends with the uninterrupted run's weights, its theta_old shadow (nft_old) and its rewards bit for bit;
its export is a WanPipeline that plain diffusers loads (its transformer = the checkpoint's weights through the
family's weight map, bit for bit) and samples a 5-frame clip from; the LoRA run's export carries the base unchanged
(bit for bit) and the trained adapter twice (diffusers' LoRA file, a PEFT directory); loaded by diffusers'
``load_lora_weights`` and by ``PeftModel``, each gives the velocity of the base with W + (alpha / r) B A merged by
hand into the named modules (1e-5 relative, fp32).
Needs: CPU, real SGLang engines (one per launch: 5 launches, ~45 s each on an idle 2-core machine); slow.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from megaflow.rundir.checkpoints import list_checkpoints

from resume_harness import Launch

pytestmark = [pytest.mark.slow, pytest.mark.engine]
REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "cpu_demo_wan.toml"
TINY = ("rollout.prompts_per_iter=2", "rollout.group_size=2", "rollout.num_steps=3", "rollout.height=32",
        "rollout.width=32", "rollout.num_frames=5", "train.micro_batch_size=2", "train.iterations=3",
        "train.save_every=1", "train.keep_checkpoints=3", "rollout.sde_type=ode", "rollout.guidance_scale=1.0")
SETTINGS = {"nft": ("algo.name=nft",), "awm": ("algo.name=awm", "lora.rank=4", "lora.alpha=8.0"),
            "dgpo": ("algo.name=dgpo", "bridge.mode=disk")}


def _launch(out: Path, name: str, *sets: str, resume: bool = False, fault: str = "") -> Path:
    extra = tuple(x for s in (f'run.output_dir="{out}"', f'run.name="{name}"', *TINY, *sets) for x in ("--set", s))
    rc, _, err = Launch(CONFIG, nproc=1, resume=False, fault=fault,
                        extra=extra + (("--resume", "auto") if resume else ())).wait(timeout=900)
    assert (rc == 0) != bool(fault), (rc, err[-3000:])
    return out / name


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(run_dir: Path, shadow: str | None = None) -> dict[str, torch.Tensor]:
    from megaflow.trainer.checkpoint import load_full_state_dict
    it, ckpt = list_checkpoints(run_dir)[-1]
    assert it == 3
    state = load_full_state_dict(ckpt / "model", shadow=shadow)[1]
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wan")
    return {algo: _launch(out, algo, *sets) for algo, sets in SETTINGS.items()}


def test_every_algorithm_trains_and_syncs(runs):
    for algo, run_dir in runs.items():
        rows = _rows(run_dir)
        assert [r["iteration"] for r in rows] == [0, 1, 2, 3], algo
        for r in rows[1:]:
            assert r["train/update_ok"] == 1.0 and r["train/grad_norm"] > 0, (algo, r)
            assert r["sync/verified"] == 1.0 and r["sync/tensors"] > 0, (algo, r)
            assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), (algo, r)
    full, lora = _rows(runs["nft"])[1:], _rows(runs["awm"])[1:]
    # LoRA: the engine gets the adapters only (fewer tensors, a fraction of the bytes), verified in the engine
    assert all(0 < a["sync/tensors"] < f["sync/tensors"] and 0 < a["sync/mbytes"] < 0.5 * f["sync/mbytes"]
               for a, f in zip(lora, full))


def test_kill9_after_the_update_resumes_exactly(runs, tmp_path):
    _launch(tmp_path, "crashed", *SETTINGS["nft"], fault="train@2")
    assert [it for it, _ in list_checkpoints(tmp_path / "crashed")] == [1]  # killed before iteration 2's checkpoint
    crashed = _launch(tmp_path, "crashed", *SETTINGS["nft"], resume=True)
    for shadow in (None, "nft_old"):
        want, got = _weights(runs["nft"], shadow), _weights(crashed, shadow)
        assert want.keys() == got.keys() and [k for k in want if not torch.equal(want[k], got[k])] == [], shadow
    assert [r.get("reward/total") for r in _rows(crashed)] == [r.get("reward/total") for r in _rows(runs["nft"])]


def test_export_is_a_wan_pipeline_diffusers_samples_from(runs, tmp_path, capsys):
    from diffusers import DiffusionPipeline

    from megaflow import cli
    from megaflow.models.registry import get_family
    from megaflow.models.wan import from_diffusers

    run_dir, out = runs["nft"], tmp_path / "export"
    assert cli.main(["export", "--run", str(run_dir), "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["family"] == "wan"
    pipe = DiffusionPipeline.from_pretrained(out, torch_dtype=torch.float32)
    assert type(pipe).__name__ == "WanPipeline"
    config = from_diffusers(json.loads((out / "transformer" / "config.json").read_text()))
    want = get_family("wan").weight_map.to_diffusers(_weights(run_dir), config)
    got = pipe.transformer.state_dict()
    assert sorted(got) == sorted(want) and [k for k in want if not torch.equal(got[k], want[k])] == []
    start = DiffusionPipeline.from_pretrained(run_dir / "tiny-pipeline").transformer.state_dict()
    assert any(not torch.equal(start[k], want[k]) for k in want)  # training moved the weights
    frames = pipe("a red circle", num_inference_steps=2, height=32, width=32, num_frames=5, guidance_scale=1.0,
                  output_type="pt", generator=torch.Generator().manual_seed(0)).frames
    assert frames.shape == (1, 5, 3, 32, 32) and torch.isfinite(frames).all()
    assert 0 <= frames.min() and frames.max() <= 1 and frames.std() > 0


def _velocity(transformer, probe: dict) -> torch.Tensor:
    with torch.no_grad():
        return transformer(**probe, return_dict=False)[0]


def test_lora_export_writes_the_adapter_diffusers_and_peft_load(runs, tmp_path):
    from diffusers import WanPipeline, WanTransformer3DModel
    from peft import PeftModel
    from safetensors.torch import load_file

    from megaflow import cli
    from megaflow.models.common.lora import TARGETS
    from megaflow.plan.dit import dims_from_config, lora_params

    run_dir, out = runs["awm"], tmp_path / "export"
    assert cli.main(["export", "--run", str(run_dir), "--out", str(out)]) == 0
    assert {"pytorch_lora_weights.safetensors", "adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in out.iterdir()}
    base = WanTransformer3DModel.from_pretrained(run_dir / "tiny-pipeline" / "transformer")
    exported = WanTransformer3DModel.from_pretrained(out / "transformer")
    assert [k for k, v in base.state_dict().items() if not torch.equal(v, exported.state_dict()[k])] == []  # frozen
    adapters = load_file(str(out / "pytorch_lora_weights.safetensors"))
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapters.items())  # trained, B != 0
    d = dims_from_config("wan", dict(base.config), "tiny")  # megaflow plan's count of them (default targets, r 4)
    assert sum(v.numel() for v in adapters.values()) == sum(lora_params(d, i, 4, TARGETS) for i in range(d.num_blocks))
    # the reference: W + (alpha / r) B A merged by hand into the base, by the adapters' module names
    merged = WanTransformer3DModel.from_pretrained(out / "transformer")
    modules = dict(merged.named_modules())
    with torch.no_grad():
        for name in {k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in adapters}:
            a, b = (adapters[f"transformer.{name}.lora_{x}.weight"] for x in "AB")
            modules[name].weight += (8.0 / 4) * b @ a
    conf = base.config
    g = torch.Generator().manual_seed(3)
    probe = dict(hidden_states=torch.randn(2, conf.in_channels, 2, 4, 4, generator=g),
                 timestep=torch.tensor([300., 800.]), encoder_hidden_states=torch.randn(2, 6, conf.text_dim, generator=g))
    want = _velocity(merged, probe)
    assert not torch.equal(want, _velocity(base, probe))
    pipe = WanPipeline.from_pretrained(out, torch_dtype=torch.float32)
    pipe.load_lora_weights(out, weight_name="pytorch_lora_weights.safetensors")  # offline: name it
    peft = PeftModel.from_pretrained(WanTransformer3DModel.from_pretrained(out / "transformer"), out).get_base_model()
    for got in (_velocity(pipe.transformer, probe), _velocity(peft, probe)):
        assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5
