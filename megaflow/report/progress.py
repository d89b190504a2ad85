"""What a person sees of a training run: progress bar, summary lines, curves and samples (``RunReporter``,
rank 0 only). Design notes: docs/design/report.md.
"""
from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path

from megaflow.config import MegaflowConfig
from megaflow.report.backends import open_backends
from megaflow.report.metrics import Evaluation, MetricsLog
from megaflow.report.plots import Panel, panel_plot

logger = logging.getLogger("megaflow.report")


class RunReporter:
    def __init__(self, run_dir: Path, cfg: MegaflowConfig, *, enabled: bool, verbose: bool, total_iterations: int,
                 start_iteration: int = 0, evaluations: list[dict] = ()):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.total, self.start = total_iterations, start_iteration
        self.log_every, self.sample_every = cfg.logging.log_every, cfg.logging.sample_every
        self.group_size = cfg.rollout.group_size
        self.fps = cfg.rollout.fps  # of video samples
        self.reward_names = list(cfg.reward.weights)
        self.curves_path = self.run_dir / "curves.png"
        self.rows: list[dict] = []  # counted iterations (> start_iteration), for the curves
        self.evals = [dict(r) for r in evaluations]  # evaluation rows ({"iteration", "eval/...": value}), the same
        self._use_bar = enabled and not verbose and sys.stderr.isatty()
        self._bar = None
        self._seconds: list[float] = []  # per counted iteration of this session (for s/it and ETA)
        self._last_t = time.perf_counter()
        self._drawn = 0  # rows in the last curves.png
        self._dropped = 0  # counted iterations whose every group was dropped (equal rewards: nothing trained)
        if enabled and start_iteration > 0:
            self.rows = previous_rows(self.run_dir / "metrics.jsonl", start_iteration)
        backends = open_backends(self.run_dir, cfg, start=start_iteration) if enabled else []
        self._metrics = MetricsLog(self.run_dir, enabled=enabled, backends=backends)

    def iteration(self, it: int, metrics: dict, images=None, captions: list[str] | None = None) -> None:
        """Record iteration ``it``: a metrics.jsonl row always; bar, summary, curves and samples for the
        counted iterations (``it > start_iteration``; the row of the initial weight sync is not one).
        ``images``: the iteration's samples ([N, 3, H, W] or N [3, H, W] tensors in [0, 1], groups in order);
        ``captions``: one per image (prompt and reward), with each image logged to a backend."""
        if not self.enabled:
            return
        row = self._metrics.write(it, metrics)
        now = time.perf_counter()
        since, self._last_t = now - self._last_t, now
        if it <= self.start:
            return
        # the loop's own time of the first one: the wall time since the initial sync may include evaluations
        first = not self._seconds and _finite(row.get("time/iteration_s"))
        self._seconds.append(row["time/iteration_s"] if first else since)
        self.rows.append(row)
        last = it >= self.total
        self._advance_bar(it, row)
        if row.get("adv/dropped_ratio") == 1.0:
            self._dropped += 1
            if self._dropped == 1:  # said once; the end of the run says whether it went on so
                self._say(f"[megaflow] iteration {it} trained nothing: in every group all samples got the same reward "
                          f"({_fmt(row.get('reward/total'))}), so algo.filter_zero_std dropped every group")
        if it % self.log_every == 0 or last:
            self._say(self.summary(row))
            self.write_curves()
        if last and self._dropped == len(self.rows):
            self._say(f"[megaflow] every batch was dropped: in all {self._dropped} iterations each group's rewards "
                      "were equal, so nothing trained (the reward cannot tell this model's samples apart)")
        if images is not None and self.sample_every > 0 and (it % self.sample_every == 0 or last):
            import torch

            from megaflow.report.metrics import save_image_grid
            from megaflow.report.video import is_clip, save_video_grid
            stacked = torch.stack(list(images))
            scale = 2 if stacked.shape[-1] < 128 else 1
            if is_clip(stacked[0]):  # videos: a short MP4 of grids, one grid per frame
                save_video_grid(stacked, self.run_dir / "samples" / f"iter{it:05d}.mp4", columns=self.group_size,
                                fps=self.fps, scale=scale, labels=captions)
            else:
                save_image_grid(stacked, self.run_dir / "samples" / f"iter{it:05d}.png", columns=self.group_size,
                                scale=scale, labels=captions)
            self._metrics.log_images(it, "samples", list(images), captions or [""] * len(images), fps=self.fps)
        if last:
            self._close_bar()

    def evaluation(self, step: int, result: Evaluation) -> None:
        """An evaluation of the weights after iteration ``step`` (0: before training) to the backends: its
        figures as numbers, its images under ``eval/images``."""
        if not self.enabled:
            return
        self._metrics.log(step, result.figures)
        if result.images:
            self._metrics.log_images(step, "eval/images", result.images, result.captions, fps=self.fps)
        self.evals.append({"iteration": step, **result.figures})
        if self.rows:
            self.write_curves()

    def summary(self, row: dict) -> str:
        """One line: iteration, reward mean ± std, KL, clip fraction, grad norm, s/it and ETA."""
        it = row["iteration"]
        per_it = sum(self._seconds) / max(len(self._seconds), 1)
        parts = [f"[megaflow] iter {it}/{self.total}", f"reward {_fmt(row.get('reward/total'))}"
                 + (f" ± {_fmt(row['reward/total_std'])}" if _finite(row.get("reward/total_std")) else "")]
        kl_key = "train/kl" if "train/kl" in row else "train/approx_kl"
        for label, key in (("kl", kl_key), ("clip", "train/clip_frac"), ("grad", "train/grad_norm")):
            if _finite(row.get(key)):
                parts.append(f"{label} {_fmt(row[key])}")
        parts.append(f"{per_it:.2f} s/it")
        parts.append(f"eta {_duration(per_it * max(self.total - it, 0))}")
        return "  ".join(parts)

    def write_curves(self) -> Path | None:
        """Redraw curves.png from the counted rows (atomic replace); None before the first one."""
        if not self.rows:
            return None
        self._drawn = len(self.rows)
        return panel_plot(curve_panels(self.rows, self.reward_names, self.evals), self.curves_path)

    def close(self) -> None:
        """Close the bar, draw the curves if rows came after the last drawing, close metrics.jsonl."""
        if not self.enabled:
            return
        self._close_bar()
        if len(self.rows) != self._drawn:
            try:
                self.write_curves()
            except OSError as e:  # a full disk at the end: the run's own error is the one to tell
                logger.warning("curves.png not redrawn: %s", e)
        self._metrics.close()

    def _advance_bar(self, it: int, row: dict) -> None:
        if not self._use_bar:
            return
        postfix = f"reward {_fmt(row['reward/total'])}" if _finite(row.get("reward/total")) else None
        if self._bar is None:  # made at the first counted iteration: prints before it would tear the bar
            from tqdm import tqdm
            self._bar = tqdm(total=self.total, initial=it, desc="train", unit="it", file=sys.stderr,
                             dynamic_ncols=True, postfix=postfix)
            return
        if postfix:
            self._bar.set_postfix_str(postfix, refresh=False)
        self._bar.update(it - self._bar.n)

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _say(self, line: str) -> None:
        if self._bar is not None:
            from tqdm import tqdm
            tqdm.write(line, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(line, flush=True)


EVAL_FIGURES = ("eval/reward_total", "eval/accuracy", "eval/partial_mean", "eval/seen_accuracy")
MAX_TAG_SERIES = 12  # per-tag evaluation lines in one panel: beyond, a legend no one can read


def curve_panels(rows: list[dict], reward_names: list[str], evals: list[dict] = ()) -> list[Panel]:
    """The charts of curves.png from metrics rows and evaluation rows (panels whose metrics never appear are left
    out): rewards, evaluation on the test prompts (overall and per tag, ``eval/<field>/<value>``), loss, learning
    rate, KL, clipping, log-prob mismatch, seconds."""
    def points(key: str, source=rows) -> list[tuple[float, float]]:
        return [(r["iteration"], r[key]) for r in source if _finite(r.get(key))]

    band = [(r["iteration"], r["reward/total"] - r["reward/total_std"], r["reward/total"] + r["reward/total_std"])
            for r in rows if _finite(r.get("reward/total")) and _finite(r.get("reward/total_std"))]
    tags = sorted({k for r in evals for k in r if k.startswith("eval/") and k.count("/") >= 2})[:MAX_TAG_SERIES]
    panels = [
        Panel("reward: batch mean ± std", {"reward/total": points("reward/total")}, {"reward/total": band}),
        Panel("reward components: batch means", {f"reward/{n}": points(f"reward/{n}") for n in reward_names}),
        Panel("evaluation (test prompts)", {k: points(k, evals) for k in EVAL_FIGURES}),
        Panel("evaluation per tag", {k: points(k, evals) for k in tags}),
        Panel("loss", {"train/loss": points("train/loss")}),
        Panel("learning rate", {"train/lr": points("train/lr")}),
        Panel("KL (to reference; to the sampling policy)",
              {k: points(k) for k in ("train/kl", "train/approx_kl")}),
        Panel("clip fraction", {k: points(k) for k in ("train/clip_frac", "train/clip_frac_stale")}),
        Panel("log-prob mismatch, trainer vs engine",
              {k: points(k) for k in ("train/logp_abs_diff_rollout", "train/is_log_ratio_abs_mean")}),
        Panel("seconds per iteration (sample: the engines' own; rollout: the trainer's wait for it)",
              {k: points(k) for k in ("time/iteration_s", "time/sample_s", "time/rollout_s", "time/train_s")}),
    ]
    out = []
    for p in panels:
        series = {k: v for k, v in p.series.items() if v}
        if series:
            out.append(Panel(p.title, series, {k: v for k, v in p.bands.items() if k in series and v}))
    return out


def previous_rows(path: Path, upto: int) -> list[dict]:
    """Rows 1..``upto`` already in metrics.jsonl (the last one of each iteration), for a resumed run."""
    if not path.is_file():
        return []
    by_it: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if 0 < row.get("iteration", 0) <= upto:
                by_it[row["iteration"]] = row
    return [by_it[i] for i in sorted(by_it)]


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _fmt(v) -> str:
    return f"{v:.4g}" if _finite(v) else "nan"


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
