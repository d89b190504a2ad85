"""RunReporter: metrics.jsonl rows, curves.png (valid, cheap to redraw, atomic), sample grids at the right
iterations, summary lines every log_every, the progress bar on a terminal, resume. Needs: CPU, no engine."""
from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from megaflow.config import load_config
from megaflow.report.plots import Panel, _draw
from megaflow.report.progress import RunReporter, curve_panels

GROUP, GROUPS, SIDE = 2, 3, 8
REWARD_LINE = (31, 119, 180)  # matplotlib's first colour, C0 (#1f77b4): the reward panel's line


def _cfg(log_every=3, sample_every=4):
    return load_config(None, [f"logging.log_every={log_every}", f"logging.sample_every={sample_every}",
                              f"rollout.group_size={GROUP}", f"rollout.prompts_per_iter={GROUPS}",
                              "reward.weights={a = 1.0, b = 0.5}"])


def _metrics(it: int) -> dict:
    return {"reward/total": 0.1 * it, "reward/total_std": 0.01 * it, "reward/a": 0.05 * it, "reward/b": 0.2,
            "reward/a_seconds": 0.01, "reward/masked_frac": 0.0, "train/approx_kl": 1e-6 * it,
            "train/clip_frac": 0.01 * it, "train/logp_abs_diff_rollout": 1e-7, "train/grad_norm": 0.5,
            "time/iteration_s": 1.0, "time/rollout_s": 0.4, "time/train_s": 0.5}


def _images() -> torch.Tensor:
    """Sample k is one flat grey k/10, so each grid cell says which sample landed there."""
    return torch.stack([torch.full((3, SIDE, SIDE), k / 10) for k in range(GROUP * GROUPS)])


def _run(reporter: RunReporter, iterations, images=True) -> None:
    for it in iterations:
        reporter.iteration(it, _metrics(it) if it else {"sync/seconds": 0.1}, images=_images() if images else None)


def test_rows_curves_grids_and_summaries(tmp_path, capsys):
    cfg = _cfg()
    reporter = RunReporter(tmp_path, cfg, enabled=True, verbose=False, total_iterations=10)
    _run(reporter, range(0, 11))
    reporter.close()

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(11))
    assert rows[0] == {"iteration": 0, "sync/seconds": 0.1}
    assert all(r["reward/total"] == pytest.approx(0.1 * r["iteration"]) for r in rows[1:])

    lines = capsys.readouterr().out.splitlines()  # stderr is no terminal here: plain lines, no bar
    assert [int(re.match(r"\[megaflow\] iter (\d+)/10 ", x).group(1)) for x in lines] == [3, 6, 9, 10]
    assert "reward 0.9 ± 0.09" in lines[2] and re.search(r" [0-9.]+ s/it  eta \dm\d\ds$", lines[2])

    with Image.open(tmp_path / "curves.png") as img:
        img.verify()
    with Image.open(tmp_path / "curves.png") as img:
        assert img.format == "PNG" and img.size == (3 * 480, 2 * 300)  # six panels, three a row
        first_panel = img.convert("RGB").crop((0, 0, 480, 300))
        assert any(c == REWARD_LINE for _, c in first_panel.getcolors(480 * 300))  # the reward line is drawn
    assert not list(tmp_path.glob(".*tmp"))  # the atomic rewrite left no temporary file

    grids = sorted(p.name for p in (tmp_path / "samples").iterdir())
    assert grids == ["iter00004.png", "iter00008.png", "iter00010.png"]  # every 4th and the last
    grid = torch.tensor(list(Image.open(tmp_path / "samples" / "iter00008.png").convert("L").getdata()))
    cell = 2 * SIDE  # images under 128 px are drawn twice their size (no captions given here: no text band)
    grid = grid.reshape(GROUPS * cell, GROUP * cell)
    for k in range(GROUP * GROUPS):  # one group per row, in order
        r, c = divmod(k, GROUP)
        assert int(grid[r * cell + SIDE, c * cell + SIDE]) == round(k / 10 * 255), k


def test_curve_panels_follow_the_metrics():
    rows = [{"iteration": it, **_metrics(it)} for it in range(1, 6)]
    panels = {p.title: p for p in curve_panels(rows, ["a", "b"])}
    reward = panels["reward: batch mean ± std"]
    assert reward.bands["reward/total"] == [(it, 0.1 * it - 0.01 * it, 0.1 * it + 0.01 * it) for it in range(1, 6)]
    assert list(panels["reward components: batch means"].series) == ["reward/a", "reward/b"]
    assert list(panels["KL (to reference; to the sampling policy)"].series) == ["train/approx_kl"]  # no train/kl
    assert list(panels["clip fraction"].series) == ["train/clip_frac"]
    assert panels["log-prob mismatch, trainer vs engine"].series["train/logp_abs_diff_rollout"][0] == (1, 1e-7)
    only_reward = [{"iteration": 1, "reward/total": 0.5}]
    assert [p.title for p in curve_panels(only_reward, ["a"])] == ["reward: batch mean ± std"]


def test_curves_show_the_evaluations_per_tag_loss_learning_rate_and_sampling_time(tmp_path):
    """curves.png's evaluation panels come from the reporter's evaluations (this session's and, resumed, the
    earlier ones it is given); loss, learning rate and the engines' own sampling time from the rows."""
    from megaflow.report.metrics import Evaluation
    rows = [{"iteration": it, **_metrics(it), "train/loss": 1.0 / it, "train/lr": 1e-4, "time/sample_s": 0.9}
            for it in range(1, 4)]
    evals = [{"iteration": 0, "eval/accuracy": 0.5, "eval/num": 4, "eval/category/color": 0.25}]
    panels = {p.title: p for p in curve_panels(rows, ["a"], evals)}
    assert panels["evaluation (test prompts)"].series == {"eval/accuracy": [(0, 0.5)]}  # eval/num is no figure
    assert panels["evaluation per tag"].series == {"eval/category/color": [(0, 0.25)]}
    assert panels["loss"].series["train/loss"] == [(1, 1.0), (2, 0.5), (3, 1 / 3)]
    assert panels["learning rate"].series["train/lr"] == [(it, 1e-4) for it in range(1, 4)]
    seconds = [p for t, p in panels.items() if t.startswith("seconds per iteration")][0]
    assert seconds.series["time/sample_s"] == [(it, 0.9) for it in range(1, 4)]

    reporter = RunReporter(tmp_path, _cfg(), enabled=True, verbose=False, total_iterations=3, start_iteration=1,
                           evaluations=evals)
    _run(reporter, [2])
    reporter.evaluation(2, Evaluation({"eval/accuracy": 0.75, "eval/category/color": 0.5}, [], []))
    reporter.close()
    assert [(r["iteration"], r["eval/accuracy"]) for r in reporter.evals] == [(0, 0.5), (2, 0.75)]
    with Image.open(tmp_path / "curves.png") as img:
        img.verify()


def test_curves_rewrite_is_cheap(tmp_path):
    """Redrawing curves.png (after every logged iteration) stays cheap by construction, not by a timer: it draws
    from the rows held in memory -- metrics.jsonl is never read back."""
    code = f"""
import builtins, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_progress import _cfg, _run
from megaflow.report.progress import RunReporter
reporter = RunReporter({str(tmp_path)!r}, _cfg(log_every=1000, sample_every=0), enabled=True, verbose=False,
                       total_iterations=1000)
_run(reporter, range(1, 101), images=False)
opened, real_open = [], builtins.open
builtins.open = lambda f, *a, **k: (opened.append(str(f)), real_open(f, *a, **k))[1]
path = reporter.write_curves()
builtins.open = real_open
reporter.close()
print(path, "matplotlib" in sys.modules, any(f.endswith("metrics.jsonl") for f in opened))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    path, _, reread = proc.stdout.split()
    assert reread == "False" and Image.open(path).size[0] > 0


def test_flat_curve_and_legend_outside_the_axes():
    """A flat series (a reward 0 throughout) gets a y range of at least ±0.05 around it, not the ±1e-6 of its
    rounding; the legend lies outside the axes, so it covers no curve."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(4.8, 3.0), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    _draw(ax, Panel("reward", {"reward/total": [(i, 0.0) for i in range(1, 5)], "reward/b": [(1, 0.0)]}), "iteration")
    fig.canvas.draw()
    lo, hi = ax.get_ylim()
    assert lo <= -0.05 and hi >= 0.05
    legend, box = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend.y1 <= box.y0, (legend, box)  # entirely below the axes


def test_resume_counts_from_the_start_iteration(tmp_path, capsys, monkeypatch):
    cfg = _cfg(log_every=1, sample_every=0)
    first = RunReporter(tmp_path, cfg, enabled=True, verbose=False, total_iterations=8)
    _run(first, range(0, 6))
    first.close()
    capsys.readouterr()

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    resumed = RunReporter(tmp_path, cfg, enabled=True, verbose=False, total_iterations=8, start_iteration=5)
    assert [r["iteration"] for r in resumed.rows] == [1, 2, 3, 4, 5]
    _run(resumed, [5, 6, 7])  # the resumed run's initial sync (5) is a row, not an iteration
    assert (resumed._bar.n, resumed._bar.total) == (7, 8)
    _run(resumed, [8])
    assert resumed._bar is None  # closed at the last iteration, before anything else prints
    resumed.close()
    assert "8/8" in term.getvalue() and "6/8" in term.getvalue()
    out = capsys.readouterr().out
    assert re.findall(r"iter (\d+)/8", out) == ["6", "7", "8"]
    rows = [json.loads(line)["iteration"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [0, 1, 2, 3, 4, 5, 5, 6, 7, 8]
    assert [r["iteration"] for r in resumed.rows] == list(range(1, 9))


def test_verbose_has_no_bar_and_disabled_writes_nothing(tmp_path, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stderr", Terminal())
    verbose = RunReporter(tmp_path / "v", _cfg(), enabled=True, verbose=True, total_iterations=3)
    _run(verbose, [1, 2])
    assert verbose._bar is None
    verbose.close()
    off = RunReporter(tmp_path / "off", _cfg(), enabled=False, verbose=False, total_iterations=3)
    _run(off, range(0, 4))
    off.close()
    assert not (tmp_path / "off").exists()


def test_dropped_batches_are_said(tmp_path, capsys):
    """An iteration whose every group was dropped (equal rewards) is said once when it first happens, and a run in
    which every iteration was so says it at its end; a run that trained on some batch says nothing more."""
    cfg = _cfg(log_every=100, sample_every=0)
    reporter = RunReporter(tmp_path / "all", cfg, enabled=True, verbose=False, total_iterations=3)
    for it in range(1, 4):
        reporter.iteration(it, {**_metrics(it), "reward/total": 0.0, "adv/dropped_ratio": 1.0})
    reporter.close()
    lines = [x for x in capsys.readouterr().out.splitlines() if "trained nothing" in x or "dropped" in x]
    assert lines == ["[megaflow] iteration 1 trained nothing: in every group all samples got the same reward (0), so "
                     "algo.filter_zero_std dropped every group",
                     "[megaflow] every batch was dropped: in all 3 iterations each group's rewards were equal, so "
                     "nothing trained (the reward cannot tell this model's samples apart)"]
    reporter = RunReporter(tmp_path / "some", cfg, enabled=True, verbose=False, total_iterations=3)
    for it in range(1, 4):
        reporter.iteration(it, {**_metrics(it), "adv/dropped_ratio": 1.0 if it == 2 else 0.25})
    reporter.close()
    assert [x for x in capsys.readouterr().out.splitlines() if "every batch" in x] == []


def test_a_full_disk_leaves_no_half_curves_file_and_does_not_hide_the_runs_error(tmp_path, monkeypatch, caplog):
    """A PNG write that fails midway (ENOSPC after some bytes) leaves no temp file; at close, a redraw that fails
    so is a warning, not a second error on top of the one that stopped the run."""
    import errno

    from matplotlib.figure import Figure

    from megaflow.report import plots

    def full_disk(self, fname, **kwargs):
        Path(fname).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    rep = RunReporter(tmp_path, _cfg(log_every=100), enabled=True, verbose=True, total_iterations=5)
    rep.iteration(1, _metrics(1))
    monkeypatch.setattr(Figure, "savefig", full_disk)
    with pytest.raises(OSError):
        plots.save_figure(Figure(), tmp_path / "x.png")
    rep.close()  # the curves of iteration 1 were not drawn yet: drawn now, and the disk is full
    assert "curves.png not redrawn" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == []
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "curves.png").exists()
