"""End to end: `megaflow train` with algo.name = awm and dgpo (ODE rollouts on a real SGLang engine, the megatron
trainer, the shared-memory bridge) on configs/cpu_demo.toml made tiny, 3 iterations (DGPO at TP=2 under torchrun), and
their exact resume.

One uninterrupted run per algorithm (module fixture, a checkpoint every iteration) is shared by every test of it:
its metrics say each iteration trained one optimizer step and blended the fast EMA with d = min(0.3, 0.001·n);
its checkpoints hold that EMA beside the model (different weights); and the same run SIGKILLed right after
iteration 2's optimizer step, then resumed with ``--resume``, ends with its weights, its fast EMA and its rewards
bit for bit (torch.equal). AWM runs with a KL to the frozen reference (a second model), DGPO without.
Needs: CPU, real SGLang engines (3 starts per algorithm, ~20-50 s each), gloo (DGPO's 2 ranks); slow.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megaflow.rundir.checkpoints import list_checkpoints

from resume_harness import Launch

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.dist]
REPO = Path(__file__).resolve().parents[2]
TINY = ("rollout.prompts_per_iter=2", "rollout.group_size=3", "rollout.num_steps=3", "rollout.height=32",
        "rollout.width=32", "train.micro_batch_size=3", "train.iterations=3", "train.save_every=1",
        "train.keep_checkpoints=3", "rollout.sde_type=ode", "train.ema_decay=0.9")
SETTINGS = {"awm": ("algo.name=awm", "algo.kl_beta=0.01"), "dgpo": ("algo.name=dgpo", "parallel.tp=2")}
NPROC = {"awm": 1, "dgpo": 2}  # DGPO end to end at TP=2 (torchrun, 2 trainer ranks), AWM in one process
SHADOW = {"awm": "awm_ema", "dgpo": "dgpo_ema_ref"}
DECAY = {"awm": "train/ema_kl_decay", "dgpo": "train/ema_ref_decay"}


def _launch(out: Path, name: str, algo: str, *, resume: bool = False, fault: str = "") -> Path:
    sets = (f'run.output_dir="{out}"', f'run.name="{name}"', *TINY, *SETTINGS[algo])
    extra = tuple(x for s in sets for x in ("--set", s))
    rc, _, err = Launch(REPO / "configs" / "cpu_demo.toml", nproc=NPROC[algo], resume=resume, fault=fault,
                        extra=extra).wait(timeout=600)
    assert (rc == 0) != bool(fault), (rc, err[-3000:])
    return out / name


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _weights(run_dir: Path, shadow: str | None = None) -> dict[str, torch.Tensor]:
    from megaflow.trainer.checkpoint import load_full_state_dict
    it, ckpt = list_checkpoints(run_dir)[-1]
    assert it == 3
    return {k: v for k, v in load_full_state_dict(ckpt / "model", shadow=shadow)[1].items()
            if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module", params=["awm", "dgpo"])
def run(request, tmp_path_factory) -> tuple[str, Path]:
    algo = request.param
    return algo, _launch(tmp_path_factory.mktemp(algo), "reference", algo)


def test_every_iteration_trains_and_blends_the_fast_ema(run):
    algo, run_dir = run
    assert f"tp = {NPROC[algo]}" in (run_dir / "config.toml").read_text()  # the layout the run trained at
    rows = _rows(run_dir)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]  # 0: the evaluation row before training
    trained = rows[1:]
    assert all(r["train/num_updates"] == 1.0 and r["train/update_ok"] == 1.0 for r in trained)
    assert [r[DECAY[algo]] for r in trained] == pytest.approx([0.001, 0.002, 0.003], rel=1e-12)
    assert all(r["train/grad_norm"] > 0 and abs(r["train/policy_loss"]) < float("inf") for r in trained)
    if algo == "awm":
        assert all(r["train/kl"] > 0 for r in trained[1:])  # θ moved away from the frozen reference
    else:
        assert all(r["train/num_items"] == 18.0 for r in trained)  # 6 samples x min(4, trunc 2 + 1) timesteps


def test_the_fast_ema_is_checkpointed_apart_from_the_model(run):
    algo, run_dir = run
    model, shadow = _weights(run_dir), _weights(run_dir, SHADOW[algo])
    assert model.keys() == shadow.keys()
    assert any(not torch.equal(model[k], shadow[k]) for k in model)


def test_kill9_after_the_update_resumes_exactly(run, tmp_path):
    algo, reference = run
    _launch(tmp_path, "crashed", algo, fault="train@2")
    crashed = _launch(tmp_path, "crashed", algo, resume=True)
    for shadow in (None, SHADOW[algo], "ema"):
        want, got = _weights(reference, shadow), _weights(crashed, shadow)
        differ = [k for k in want if not torch.equal(want[k], got[k])]
        assert not differ, (shadow, differ[:3])
    assert [r.get("reward/total") for r in _rows(crashed)] == [r.get("reward/total") for r in _rows(reference)]
