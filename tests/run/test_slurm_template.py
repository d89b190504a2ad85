"""scripts/launch.sh and scripts/slurm/train.sbatch, rendered without starting anything (DRY_RUN=1: launch.sh
prints its torchrun command and exits). The sbatch script runs under stand-ins for SLURM's ``srun`` (one task per
node, SLURM_NODEID set, options dropped) and ``scontrol show hostnames``; each node's command must be the torchrun
launch with that node's rank, the allocation's first host as rendezvous, and ``--resume auto`` before the user's
arguments. ``launch.sh --help`` must describe every environment variable the script reads, not megaflow's help.
Needs: CPU, bash, no torch (< 2 s)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "scripts" / "launch.sh"
SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"
SRUN = """#!/usr/bin/env bash
# srun stand-in: drop srun's own options, then run the command once per node with SLURM_NODEID set
while [[ "$1" == --* ]]; do shift; done
for ((n = 0; n < SLURM_NNODES; n++)); do SLURM_NODEID=$n "$@" || exit $?; done
"""
SCONTROL = """#!/usr/bin/env bash
[ "$1 $2" = "show hostnames" ] && printf 'gpu-a17\\ngpu-a18\\n'
"""


def _env(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "NNODES", "NODE_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    return {**env, "DRY_RUN": "1", "VENV": str(Path(sys.executable).parents[1]), **extra}


def _sbatch(tmp_path: Path, job_id: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = _env(tmp_path, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_NNODES="2",
               SLURM_JOB_NODELIST="gpu-a[17-18]", SLURM_JOB_ID=job_id, SLURM_GPUS_ON_NODE="8",
               SLURM_SUBMIT_DIR=str(REPO))
    return subprocess.run(["bash", str(SBATCH), "-c", "configs/flux_dev_2x8xh100.toml", "--set",
                           "train.iterations=5"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


def _launch_lines(port: int) -> list[str]:
    return [f"launch.sh: torchrun --nnodes 2 --node-rank {n} --nproc-per-node 8 --master-addr gpu-a17 "
            f"--master-port {port} --shutdown-timeout 600 -m megaflow.cli train --resume auto "
            "-c configs/flux_dev_2x8xh100.toml --set train.iterations=5" for n in (0, 1)]


def test_sbatch_renders_one_torchrun_per_node(tmp_path):
    r = _sbatch(tmp_path, "4242")
    assert r.returncode == 0, r.stderr
    assert [x for x in r.stderr.splitlines() if x.startswith("launch.sh: ")] == _launch_lines(20000 + 4242), r.stderr


def test_sbatch_job_id_runs_no_command(tmp_path):
    """A SLURM_JOB_ID holding a command substitution (bash arithmetic would run one inside an array index) is not
    a number: the port falls back to 20000 and the command never runs."""
    marker = tmp_path / "ran"
    r = _sbatch(tmp_path, f"a[$(touch {marker})]")
    assert r.returncode == 0, r.stderr
    assert not marker.exists()
    assert [x for x in r.stderr.splitlines() if x.startswith("launch.sh: ")] == _launch_lines(20000), r.stderr


def test_sbatch_outside_the_repository_is_one_line(tmp_path):
    env = _env(tmp_path, MEGAFLOW_REPO=str(tmp_path), SLURM_NNODES="1")
    r = subprocess.run(["bash", str(SBATCH)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not the megaflow repository" in r.stderr


def test_launch_defaults_and_help(tmp_path):
    r = subprocess.run(["bash", str(LAUNCH), "-c", "configs/cpu_demo.toml"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, env=_env(tmp_path, NPROC="2"))
    assert r.returncode == 0 and r.stderr.strip() == (
        "launch.sh: torchrun --nnodes 1 --node-rank 0 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29500 "
        "--shutdown-timeout 600 -m megaflow.cli train -c configs/cpu_demo.toml"), r.stderr
    h = subprocess.run(["bash", str(LAUNCH), "--help"], capture_output=True, text=True, timeout=60)
    assert h.returncode == 0 and h.stdout.startswith("Usage: ") and "usage: megaflow" not in h.stdout
    body = LAUNCH.read_text().split("\nEOF\n", 1)[1]  # the script after its usage text
    read = set(re.findall(r"\$\{([A-Z_]+)[:}]", body)) - {"BASH_SOURCE"}
    assert read and all(re.search(rf"^  {v} ", h.stdout, re.M) for v in read), sorted(read)
