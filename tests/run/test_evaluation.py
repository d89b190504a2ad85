"""``megaflow train``'s evaluation hook (megaflow.commands.evaluation) on a fake sampler: the requests it makes
(ODE, one per test prompt, fixed seeds, the prompts' metadata), its reward figures against the reward computed
directly, and what it writes (eval.jsonl rows, captioned grids) and returns for the metrics backends (the row's
figures, the images with prompt and score). Needs: CPU, no engine (~2 s)."""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from megaflow.commands import evaluation
from megaflow.config import load_config
from megaflow.rewards.registry import build_reward
from megaflow.rundir.eval_log import resume_eval_log

COLORS = [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.9, 0.2, 0.1), (0.0, 0.0, 1.0)]


class FakeSampler:
    """``generate(requests)`` like the run's sampler: a solid image per request, colour by request order."""

    def __init__(self):
        self.requests = []

    def generate(self, requests):
        self.requests.append(list(requests))
        out = []
        for i, r in enumerate(requests):
            for k in range(r.num_outputs):  # a request's outputs in order; sample k darker by k/10
                image = torch.tensor(COLORS[i % len(COLORS)]).view(3, 1, 1).expand(3, r.height, r.width) * (1 - k / 10)
                out.append(SimpleNamespace(image=image.clone()))
        return out


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    rows = [{"prompt": f"prompt {i}", "tag": i} for i in range(4)]
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [f'data.test_prompts="{tmp_path / "held.jsonl"}"', "eval.every=2", "eval.num=3",
                             "eval.seed=5", "eval.num_steps=2", "rollout.num_steps=4", "rollout.height=16",
                             "rollout.width=16", "train.iterations=3", "reward.weights={color_target = 2.0}",
                             'reward.kwargs={color_target = {target = "red"}}'])
    monkeypatch.setattr(evaluation, "settled", lambda c, run_dir: c)  # no pipeline to read in this test
    return cfg


def test_hook_samples_ode_and_scores_with_the_runs_rewards(cfg, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    hook, sampler = evaluation.eval_hook(cfg, run_dir), FakeSampler()
    results = [hook(sampler, when) for when in ("before", 2, "after")]
    reqs = sampler.requests[0]
    assert [r.prompt for r in reqs] == ["prompt 0", "prompt 1", "prompt 2"]
    assert [r.metadata for r in reqs] == [{"tag": 0}, {"tag": 1}, {"tag": 2}]
    assert {r.sde_type for r in reqs} == {"ode"} and {r.num_outputs for r in reqs} == {1}
    assert {r.num_steps for r in reqs} == {2} and len({r.seed for r in reqs}) == 3
    assert [r.seed for r in sampler.requests[2]] == [r.seed for r in reqs]  # the same noise every time

    images = torch.stack([torch.tensor(c).view(3, 1, 1).expand(3, 16, 16) for c in COLORS[:3]])
    direct = build_reward("color_target", target="red")(images, [r.prompt for r in reqs])
    rows = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 2, 3]
    assert [r["when"] for r in rows] == ["before", "iteration", "after"]
    for row in rows:
        assert row["eval/color_target"] == pytest.approx(float(direct.mean()), rel=1e-5)
        assert row["eval/reward_total"] == pytest.approx(2.0 * float(direct.mean()), rel=1e-5)
        assert row["eval/num"] == 3
    for it in (0, 2, 3):
        assert (run_dir / "eval" / f"iter{it:05d}.png").is_file()
    for row, result in zip(rows, results):  # what the loop hands the metrics backends
        assert result.figures == {k: v for k, v in row.items() if k.startswith("eval/")}
        assert [tuple(im.shape) for im in result.images] == [(3, 16, 16)] * 3
        assert torch.equal(torch.stack(result.images), images.float())
        scores = 2.0 * direct
        assert result.captions == [f"prompt {i} | reward {float(scores[i]):.3f}" for i in range(3)]


def test_samples_per_prompt_and_breakdown_by_metadata(cfg, tmp_path):
    """eval.samples_per_prompt = 3: one request per prompt of 3 outputs, the first seed the single-sample one, the
    others distinct; every figure is the mean over the 9 images, and eval.group_by = ["parity"] gives the mean total
    of each parity's samples, computed here from the reward called directly."""
    rows = [{"prompt": f"prompt {i}", "parity": ["even", "odd"][i % 2]} for i in range(3)]
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    one, sampler = FakeSampler(), FakeSampler()
    (tmp_path / "one").mkdir()
    evaluation.eval_hook(cfg, tmp_path / "one")(one, "before")  # one sample per prompt
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, test_prompts=str(tmp_path / "held.jsonl")),
                              eval=dataclasses.replace(cfg.eval, samples_per_prompt=3, group_by=["parity"]))
    result = evaluation.eval_hook(cfg, tmp_path)(sampler, "after")
    reqs = sampler.requests[0]
    assert [r.num_outputs for r in reqs] == [3, 3, 3]
    assert [r.output_seeds()[0] for r in reqs] == [r.output_seeds()[0] for r in one.requests[0]]
    assert len({s for r in reqs for s in r.output_seeds()}) == 9
    images = torch.stack([torch.tensor(COLORS[i]).view(3, 1, 1).expand(3, 16, 16) * (1 - k / 10)
                          for i in range(3) for k in range(3)])
    direct = 2.0 * build_reward("color_target", target="red")(images, ["p"] * 9)
    (row,) = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert row["eval/reward_total"] == pytest.approx(float(direct.mean()), rel=1e-5)
    assert row["eval/parity/even"] == pytest.approx(float(direct[[0, 1, 2, 6, 7, 8]].mean()), rel=1e-5)
    assert row["eval/parity/odd"] == pytest.approx(float(direct[3:6].mean()), rel=1e-5)
    assert row["eval/num"] == 3 and row["eval/samples"] == 9 and len(result.images) == 9
    with pytest.raises(ValueError, match="no test prompt of data.test_prompts has the metadata field 'pariti'"):
        evaluation.eval_hook(dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, group_by=["pariti"])),
                             tmp_path)


def test_resumed_run_keeps_one_after(tmp_path):
    """A run finished at iteration 3 ("after") and resumed from its checkpoint at 3 to run on: its "after" becomes an
    "iteration" row; a row written after the checkpoint a run resumes from (2) is dropped."""
    rows = [{"iteration": 0, "when": "before"}, {"iteration": 2, "when": "iteration"},
            {"iteration": 3, "when": "after"}]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    resume_eval_log(tmp_path, 3)
    assert [json.loads(x)["when"] for x in (tmp_path / "eval.jsonl").read_text().splitlines()] == \
        ["before", "iteration", "iteration"]
    resume_eval_log(tmp_path, 2)
    assert [json.loads(x)["iteration"] for x in (tmp_path / "eval.jsonl").read_text().splitlines()] == [0, 2]


def test_test_prompts_win_over_shapes_and_a_prompt_file_alone_is_refused(cfg, tmp_path):
    sampler = FakeSampler()
    evaluation.eval_hook(cfg, tmp_path)(sampler, "before")  # data.prompts = "shapes" here: test prompts still
    assert [r.prompt for r in sampler.requests[0]] == ["prompt 0", "prompt 1", "prompt 2"]
    (tmp_path / "train.txt").write_text("a red circle\n")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, prompts=str(tmp_path / "train.txt"),
                                                            test_prompts=""))
    with pytest.raises(ValueError, match="eval.every needs test prompts"):
        evaluation.eval_hook(cfg, tmp_path)


def test_shapes_hook_runs_shapeeval_held_out(cfg, tmp_path):
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, test_prompts=""),
                              eval=dataclasses.replace(cfg.eval, num=4, num_seen=0),
                              rollout=dataclasses.replace(cfg.rollout, height=32, width=32))
    sampler = FakeSampler()
    result = evaluation.eval_hook(cfg, tmp_path)(sampler, 2)
    assert {r.sde_type for r in sampler.requests[0]} == {"ode"} and len(sampler.requests[0]) == 4
    (row,) = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert row["iteration"] == 2 and row["eval/num"] == 4 and 0.0 <= row["eval/accuracy"] <= 1.0
    assert "eval/partial_mean" in row and any(k.startswith("eval/category/") for k in row)
    assert (tmp_path / "eval" / "iter00002.png").is_file()
    assert result.figures == {k: v for k, v in row.items() if k.startswith("eval/")}
    prompts = [r.prompt for r in sampler.requests[0]]
    assert [c.rsplit(" | ", 1)[0] for c in result.captions] == prompts
    assert {c.rsplit(" | ", 1)[1] for c in result.captions} <= {"pass", "fail"}
    saved = (torch.tensor(COLORS) * 255).round() / 255  # each image is its request's colour, as saved (PNG)
    assert torch.equal(torch.stack([im[:, 0, 0] for im in result.images]), saved)


def test_shapes_figures():
    res = {"accuracy": 0.5, "partial_mean": 0.7, "num": 4, "per_category": {"single": 1.0, "count": 0.0},
           "seen": {"accuracy": 0.25}}
    assert evaluation.shapes_figures(res) == {
        "eval/accuracy": 0.5, "eval/partial_mean": 0.7, "eval/num": 4, "eval/seen_accuracy": 0.25,
        "eval/category/single": 1.0, "eval/category/count": 0.0}


def test_demo_evaluation_for_the_backends(tmp_path):
    """The demo's ShapeEval result as the reporter takes it: the held-out figures, the TRAIN prompts' accuracy,
    and the held-out images saved under the result's folder, captioned with prompt and verdict."""
    from megaflow.commands.demo import demo_evaluation
    from megaflow.shapeeval.evaluate import evaluate_engine

    sampler = FakeSampler()
    res = evaluate_engine(sampler, num=4, num_seen=0, seed=0, num_steps=2, resolution=32, out_dir=tmp_path / "ev")
    res["train"] = evaluate_engine(sampler, num=4, num_seen=0, seed=0, num_steps=2, resolution=32, split="train",
                                   out_dir=tmp_path / "ev_train")
    result = demo_evaluation(res)
    assert result.figures == {**evaluation.shapes_figures(res), "eval/train_accuracy": res["train"]["accuracy"]}
    assert [c.rsplit(" | ", 1)[0] for c in result.captions] == [r.prompt for r in sampler.requests[0]]
    assert [c.endswith("| pass") for c in result.captions] == res["passed"]
    assert len(result.images) == 4 and tuple(result.images[0].shape) == (3, 32, 32)
