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
    for name in ALGO_CONFIGS.values():
        shutil.copy(CONFIGS / name, tmp_path / name)
    awm = tmp_path / ALGO_CONFIGS["awm"]
    awm.write_text(awm.read_text().replace("[eval]\nnum = 300", "[eval]\nnum = 200"))
    with pytest.raises(ValueError, match="awm's eval differs from nft's"):
        recipes(["nft", "awm"], tmp_path, [])


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
