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
from megaflow.report.plots import _COLORS
from megaflow.report.progress import RunReporter, curve_panels

GROUP, GROUPS, SIDE = 2, 3, 8


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
        assert any(c == _COLORS[0] for _, c in first_panel.getcolors(480 * 300))  # the reward line is drawn
    assert not list(tmp_path.glob(".*tmp"))  # the atomic rewrite left no temporary file

    grids = sorted(p.name for p in (tmp_path / "samples").iterdir())
    assert grids == ["iter00004.png", "iter00008.png", "iter00010.png"]  # every 4th and the last
    grid = torch.tensor(list(Image.open(tmp_path / "samples" / "iter00008.png").convert("L").getdata()))
    grid = grid.reshape(GROUPS * SIDE, GROUP * SIDE)
    for k in range(GROUP * GROUPS):  # one group per row, in order
        r, c = divmod(k, GROUP)
        assert int(grid[r * SIDE + SIDE // 2, c * SIDE + SIDE // 2]) == round(k / 10 * 255), k


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


def test_curves_rewrite_is_cheap(tmp_path):
    """Redrawing curves.png (after every logged iteration) stays cheap by construction, not by a timer: it draws
    with Pillow from the rows held in memory -- no plotting library imported, metrics.jsonl never read back."""
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
    path, plotting, reread = proc.stdout.split()
    assert (plotting, reread) == ("False", "False") and Image.open(path).size[0] > 0


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


def test_a_full_disk_leaves_no_half_curves_file_and_does_not_hide_the_runs_error(tmp_path, monkeypatch, caplog):
    """A PNG write that fails midway (ENOSPC after some bytes) leaves no temp file; at close, a redraw that fails
    so is a warning, not a second error on top of the one that stopped the run."""
    import errno

    from megaflow.report import plots

    def full_disk(self, fp, format=None, **params):
        Path(fp).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    rep = RunReporter(tmp_path, _cfg(log_every=100), enabled=True, verbose=True, total_iterations=5)
    rep.iteration(1, _metrics(1))
    monkeypatch.setattr(Image.Image, "save", full_disk)
    with pytest.raises(OSError):
        plots.save_png(Image.new("RGB", (4, 4)), tmp_path / "x.png")
    rep.close()  # the curves of iteration 1 were not drawn yet: drawn now, and the disk is full
    assert "curves.png not redrawn" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == []
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "curves.png").exists()
