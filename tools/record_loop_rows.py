"""Record the synchronous loop's metrics rows on tiny runs, as the reference a test holds later loops to.

    python tools/record_loop_rows.py --tree CHECKOUT --out tests/run/data/synchronous_rows.json

Runs ``megaflow train`` from ``CHECKOUT`` (any checkout of megaflow: its ``megaflow`` package and its
``configs/cpu_demo.toml`` are used, with this environment's dependencies) for each run below: FlowGRPO and
DiffusionNFT on the tiny CPU demo, 3 iterations each, with the same prompts, seeds and initial weights. Keeps
every row's keys that do not measure time or memory, and writes them with the settings and the checkout's
commit. The shipped file was recorded from a checkout of the loop before ``train.max_staleness`` existed, so
``tests/run/test_loop.py`` shows that ``max_staleness = 0`` still runs that loop: counts, sizes and flags
exactly, float metrics within the tolerance it states for another CPU's float path (on the recording CPU, bit for
bit). Re-record only for a change meant to alter the synchronous loop's numbers, and say so in the commit.
Refuses to overwrite ``--out`` (exit code 2).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TINY = ["rollout.prompts_per_iter=2", "rollout.group_size=3", "rollout.num_steps=3", "rollout.height=32",
        "rollout.width=32", "train.micro_batch_size=3", "train.iterations=3"]
RUNS = {"flowgrpo": TINY,
        "nft": [*TINY, 'algo.name="nft"', 'rollout.sde_type="ode"', "algo.nft_num_timesteps=2"]}
CONFIG = "configs/cpu_demo.toml"


def measures_time_or_memory(key: str) -> bool:
    """Keys whose values differ between two runs of the same loop: wall times and resident memory."""
    return key.startswith(("time/", "mem/")) or key.endswith(("_s", "seconds"))


def record(tree: Path, settings: list[str], out_dir: Path) -> list[dict]:
    """``megaflow train`` from ``tree`` with ``settings``; its metrics rows without time or memory keys."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
    args = [sys.executable, "-m", "megaflow.cli", "train", "-c", CONFIG, "--set", f'run.output_dir="{out_dir}"',
            "--set", 'run.name="rows"']
    for setting in settings:
        args += ["--set", setting]
    r = subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"megaflow train in {tree} failed ({r.returncode}): {r.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out_dir / "rows" / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not measures_time_or_memory(k)} for row in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", required=True, help="the megaflow checkout to run")
    parser.add_argument("--out", required=True, help="the JSON file to write")
    args = parser.parse_args(argv)
    tree, out = Path(args.tree).resolve(), Path(args.out)
    if not (tree / "megaflow" / "__init__.py").is_file() or not (tree / CONFIG).is_file():
        print(f"record_loop_rows: {tree} is not a megaflow checkout (no megaflow/ or {CONFIG})", file=sys.stderr)
        return 2
    if out.exists():
        print(f"record_loop_rows: {out} exists; not overwriting", file=sys.stderr)
        return 2
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: {"settings": settings, "rows": record(tree, settings, Path(tmp) / name)}
                for name, settings in RUNS.items()}
    out.write_text(json.dumps({"commit": commit, "config": CONFIG, "runs": runs}, indent=1) + "\n")
    print(f"wrote {out}: {', '.join(f'{n} ({len(r['rows'])} rows)' for n, r in runs.items())} from {commit[:7]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
