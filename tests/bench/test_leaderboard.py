"""``megaflow bench learn --algos``: the recipes it compares are checked before any run, and its table and
intervals come from the per-algorithm reports (synthetic reports here; the real run is in the closing notes)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megaflow.bench.leaderboard import ALGO_CONFIGS, entry, recipes, table

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_every_recipe_is_its_algorithm_on_one_evaluation():
    cfgs = recipes(list(ALGO_CONFIGS), CONFIGS, [])
    assert {a: c.algo.name for a, c in cfgs.items()} == {a: a for a in ALGO_CONFIGS}
    assert len({repr((c.eval, c.model.pretrained, c.data.prompts)) for c in cfgs.values()}) == 1


def test_unknown_algorithm_or_a_different_evaluation_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown ppo"):
        recipes(["nft", "ppo"], CONFIGS, [])
    (tmp_path / "configs").mkdir()
    (tmp_path / "assets").symlink_to(CONFIGS.parent / "assets")  # the configs' paths are relative to them
    for name in ALGO_CONFIGS.values():
        shutil.copy(CONFIGS / name, tmp_path / "configs" / name)
    awm = tmp_path / "configs" / ALGO_CONFIGS["awm"]
    awm.write_text(awm.read_text().replace("[eval]\nnum = 300", "[eval]\nnum = 200"))
    with pytest.raises(ValueError, match="awm's eval differs from nft's"):
        recipes(["nft", "awm"], tmp_path / "configs", [])


def _side(before: float, curve: list[tuple[float, float]]) -> dict:
    def ev(acc):
        return {"accuracy": acc, "ci95": [acc - 0.05, acc + 0.05], "seen_accuracy": acc + 0.01,
                "per_category": {"count": acc}}
    return {"before": ev(before), "after": ev(curve[-1][1]), "rl_wall_s": curve[-1][0],
            "curve": [{"rl_s": t, "accuracy": a} for t, a in curve], "peak_rss_mib": {"trainer": 900, "engine_workers": 700}}


def test_rows_and_table():
    cfgs = recipes(["nft", "flowgrpo"], CONFIGS, ["train.iterations=10"])
    nft = entry(cfgs["nft"], _side(0.5, [(0, 0.5), (60, 0.62), (120, 0.75)]))
    grpo = entry(cfgs["flowgrpo"], _side(0.5, [(0, 0.5), (120, 0.55)]))
    assert nft["held_out"]["gain"] == pytest.approx(0.25) and nft["time_to_gain_s"] == {"+0.1": 60, "+0.2": 120}
    assert grpo["time_to_gain_s"] == {"+0.1": None, "+0.2": None}
    assert nft["images_sampled"] == 10 * 12 * 8 and grpo["images_sampled"] == 10 * 8 * 8
    lines = table({"flowgrpo": grpo, "nft": nft}).splitlines()
    assert lines[2].startswith("| nft | 0.50 -> 0.75 [0.70, 0.80] | +0.25 | 0.51 -> 0.76 | 1.0 | 2.0 | 2.0 | 960 |")
    assert lines[3].startswith("| flowgrpo |") and "| - | - |" in lines[3] and lines[3].endswith("| 1600 |")


def _report(cfg, side: dict, *, eval_every: int = 5, eval_num: int = 50) -> dict:
    from megaflow.bench.learn import eval_record, recipe_record
    return {"recipe": recipe_record(cfg), "eval": eval_record(cfg, eval_every, eval_num), "target_gain": 0.05,
            "sides": {"megaflow": side}}


def test_reuse_tabulates_an_earlier_report_and_runs_only_the_others(tmp_path, monkeypatch):
    import json

    from megaflow.bench import leaderboard as lb
    over = ["train.iterations=10"]
    cfgs = recipes(["nft", "dgpo"], CONFIGS, over)
    (tmp_path / "nft.json").write_text(json.dumps(_report(cfgs["nft"], _side(0.5, [(0, 0.5), (60, 0.7)]))))
    ran = []

    def run_one(algo, config, overrides, out, *, eval_every, eval_num):
        ran.append(algo)
        report = _report(cfgs[algo], _side(0.5, [(0, 0.5), (60, 0.6)]), eval_every=eval_every, eval_num=eval_num)
        out.write_text(json.dumps(report))
        return report

    monkeypatch.setattr(lb, "run_one", run_one)
    out = lb.leaderboard(["nft", "dgpo"], config_dir=CONFIGS, overrides=over, out_dir=tmp_path, eval_every=5,
                         eval_num=50, reuse=["nft"])
    assert ran == ["dgpo"] and out["reused"] == ["nft"]
    rows = out["algorithms"]
    assert rows["nft"]["held_out"]["after"] == 0.7 and rows["dgpo"]["held_out"]["after"] == 0.6
    assert (tmp_path / "leaderboard.md").read_text().splitlines()[2].startswith("| nft | 0.50 -> 0.70")


def test_reuse_refuses_a_report_of_another_recipe_or_evaluation_before_any_run(tmp_path, monkeypatch):
    import json

    from megaflow.bench import leaderboard as lb
    monkeypatch.setattr(lb, "run_one", lambda *a, **k: pytest.fail("a run started before the checks"))
    over = ["train.iterations=10"]
    cfgs = recipes(["nft", "dgpo"], CONFIGS, over)
    kw = dict(config_dir=CONFIGS, overrides=over, out_dir=tmp_path, eval_every=5, eval_num=50)
    with pytest.raises(ValueError, match=r"--reuse dgpo: .*dgpo.json: no bench learn report to reuse \(No such file"):
        lb.leaderboard(["nft", "dgpo"], reuse=["dgpo"], **kw)
    with pytest.raises(ValueError, match="--reuse awm: not one of --algos"):
        lb.leaderboard(["nft", "dgpo"], reuse=["awm"], **kw)
    stale = recipes(["dgpo"], CONFIGS, [*over, "algo.dgpo_trunc_steps=9"])["dgpo"]
    (tmp_path / "dgpo.json").write_text(json.dumps(_report(stale, _side(0.5, [(0, 0.5), (60, 0.6)]))))
    with pytest.raises(ValueError, match="ran recipe tables.algo.dgpo_trunc_steps = 9, shapes_demo_dgpo.toml with "
                       "these options gives 4: run it again"):
        lb.leaderboard(["nft", "dgpo"], reuse=["dgpo"], **kw)
    (tmp_path / "dgpo.json").write_text(json.dumps(_report(cfgs["dgpo"], _side(0.5, [(0, 0.5)]), eval_num=100)))
    with pytest.raises(ValueError, match="ran eval eval_num = 100, shapes_demo_dgpo.toml with these options gives 50"):
        lb.leaderboard(["nft", "dgpo"], reuse=["dgpo"], **kw)


def _damaged(change):
    """A valid nft report (as test_reuse_... writes it) after ``change(report)``; the text to write."""
    import json

    def make(cfg) -> str:
        report = _report(cfg, _side(0.5, [(0, 0.5), (60, 0.7)]))
        out = change(report)
        return out if isinstance(out, str) else json.dumps(report)
    return make


def _set(dotted: str, value):
    def change(report):
        *parents, last = dotted.split(".")
        table = report
        for p in parents:
            table = table[int(p)] if isinstance(table, list) else table[p]
        table[int(last) if isinstance(table, list) else last] = value
    return _damaged(change)


def _drop(dotted: str):
    def change(report):
        *parents, last = dotted.split(".")
        table = report
        for p in parents:
            table = table[int(p)] if isinstance(table, list) else table[p]
        del table[last]
    return _damaged(change)


REPORTS = {  # a damaged report -> its one line (after "--reuse nft: <out_dir>/nft.json")
    "no sides": (_drop("sides"), ": sides is missing"),
    "no megaflow side": (_set("sides", {"baseline": {}}), ": sides.megaflow is missing"),
    "sides a list": (_set("sides", [1, 2]), ": sides is [1, 2], want a JSON object"),
    "accuracy a string": (_set("sides.megaflow.after.accuracy", "0.7"),
                          ": sides.megaflow.after.accuracy is '0.7', want a number"),
    "accuracy null": (_set("sides.megaflow.before.accuracy", None), ": sides.megaflow.before.accuracy is None"),
    "accuracy NaN": (_set("sides.megaflow.before.accuracy", float("nan")), ".before.accuracy is nan, want a number"),
    "accuracy a bool": (_set("sides.megaflow.before.accuracy", True), ".before.accuracy is True, want a number"),
    "ci95 of three": (_set("sides.megaflow.after.ci95", [0, 1, 2]), ".after.ci95 has 3 entries, want [low, high]"),
    "ci95 of strings": (_set("sides.megaflow.after.ci95", ["a", "b"]), ".after.ci95[0] is 'a', want a number"),
    "curve a table": (_set("sides.megaflow.curve", {"rl_s": 1}), ".curve is {'rl_s': 1}, want a list"),
    "curve point a list": (_set("sides.megaflow.curve.1", [60, 0.7]), ".curve[1] is [60, 0.7], want a JSON object"),
    "no curve": (_drop("sides.megaflow.curve"), ".curve is missing"),
    "curve point without rl_s": (_drop("sides.megaflow.curve.0.rl_s"), ".curve[0].rl_s is missing"),
    "rl_wall_s null": (_set("sides.megaflow.rl_wall_s", None), ".rl_wall_s is None, want a number"),
    "peak rss a list": (_set("sides.megaflow.peak_rss_mib", [1]), ".peak_rss_mib is [1], want a JSON object|null"),
    "peak rss of strings": (_set("sides.megaflow.peak_rss_mib", {"trainer": "900"}),
                            ".peak_rss_mib.trainer is '900', want a number"),
    "recipe a list": (_set("recipe", ["x"]), ": recipe is ['x'], want a JSON object"),
    "a list, not a report": (_damaged(lambda r: "[1, 2, 3]"),
                             " is not a bench learn report (a JSON list, not an object)"),
    "not JSON": (_damaged(lambda r: "{\"sides\": "), " is not a bench learn report (not JSON: "),
    "nested 100000 deep": (_damaged(lambda r: "[" * 100_000 + "]" * 100_000), "nested too deeply to read"),
    "nested 40 deep": (_damaged(lambda r: '{"sides": ' + "[" * 40 + "]" * 40 + "}"),
                       "nests more than 32 lists or objects deep"),
    "a long string": (_set("sides.megaflow.rl_wall_s", "x" * 10_000), ".rl_wall_s is a str, want a number"),
}


@pytest.mark.parametrize("name", sorted(REPORTS))
def test_reuse_of_a_malformed_report_is_one_line_naming_the_field(name, tmp_path, monkeypatch):
    from megaflow.bench import leaderboard as lb
    monkeypatch.setattr(lb, "run_one", lambda *a, **k: pytest.fail("a run started before the checks"))
    over = ["train.iterations=10"]
    cfgs = recipes(["nft"], CONFIGS, over)
    make, needle = REPORTS[name]
    (tmp_path / "nft.json").write_text(make(cfgs["nft"]))
    with pytest.raises(ValueError) as e:
        lb.leaderboard(["nft"], reuse=["nft"], config_dir=CONFIGS, overrides=over, out_dir=tmp_path, eval_every=5,
                       eval_num=50)
    line = str(e.value)
    assert line.startswith(f"--reuse nft: {tmp_path / 'nft.json'}") and needle in line, line
    assert "\n" not in line and len(line) < 300, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nft.json"]  # nothing written


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "directory"])
def test_reuse_of_a_report_that_is_no_file_is_refused_unread(kind, tmp_path):
    import os

    from megaflow.bench import leaderboard as lb
    path = tmp_path / "nft.json"
    if kind == "fifo":
        os.mkfifo(path)  # reading it would wait forever
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")  # reading it would never end
    with pytest.raises(ValueError, match=r"nft.json is not a regular file \(a bench learn report is a JSON file\)"):
        lb.leaderboard(["nft"], reuse=["nft"], config_dir=CONFIGS, overrides=["train.iterations=10"],
                       out_dir=tmp_path, eval_every=5, eval_num=50)
