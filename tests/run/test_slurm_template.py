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

import pytest

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


def test_sbatch_outside_the_repository_is_one_line(tmp_path):
    env = _env(tmp_path, MEGAFLOW_REPO=str(tmp_path), SLURM_NNODES="1")
    r = subprocess.run(["bash", str(SBATCH)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not the megaflow repository" in r.stderr


def test_launch_defaults_and_help(tmp_path):
    r = subprocess.run(["bash", str(LAUNCH), "-c", "configs/cpu_demo.toml"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, env=_env(tmp_path, NPROC="2"))
    assert r.returncode == 0 and r.stderr.strip().splitlines() == [
        "launch.sh: torchrun --nnodes 1 --node-rank 0 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29500 "
        "--shutdown-timeout 600 -m megaflow.cli train -c configs/cpu_demo.toml",
        "[megaflow] --dry-run: the config fits a launch of 2 process(es)"], r.stderr
    # DRY_RUN checks the config against NNODES x NPROC: parallel.gpus of another size is one line, exit 2
    r = subprocess.run(["bash", str(LAUNCH), "-c", "configs/cpu_demo.toml", "--set", "parallel.gpus=4"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60, env=_env(tmp_path, NPROC="1", NNODES="2"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 2 and "parallel.gpus = 4 but 2 process(es) were launched" in lines[1], \
        r.stderr
    h = subprocess.run(["bash", str(LAUNCH), "--help"], capture_output=True, text=True, timeout=60)
    assert h.returncode == 0 and h.stdout.startswith("Usage: ") and "usage: megaflow" not in h.stdout
    body = LAUNCH.read_text().split("\nEOF\n", 1)[1]  # the script after its usage text
    read = set(re.findall(r"\$\{([A-Z_]+)[:}]", body)) - {"BASH_SOURCE"}
    assert read and all(re.search(rf"^  {v} ", h.stdout, re.M) for v in read), sorted(read)


# srun stand-in that runs the node tasks concurrently and passes SIGTERM on to them, as srun does; its exit code
# is the worst task's.
SRUN_CONCURRENT = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do echo "srun $1" >> "$LOG"; shift; done
pids=()
for ((n = 0; n < SLURM_NNODES; n++)); do SLURM_NODEID=$n "$@" & pids+=($!); done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
rc=0
for p in "${pids[@]}"; do
  while true; do wait "$p"; r=$?; kill -0 "$p" 2>/dev/null || break; done
  [ "$r" -gt "$rc" ] && rc=$r
done
exit $rc
"""
SCONTROL_RECORDING = SCONTROL + '[ "$1" = "requeue" ] && echo "requeue $2" >> "$LOG"\nexit 0\n'
# launch.sh stand-in: a rank that runs until SIGTERM, then "checkpoints" and exits 143 as megaflow does; with
# TASK_EXIT it ends at once with that code.
FAKE_LAUNCH = """#!/usr/bin/env bash
trap 'echo "checkpoint $NODE_RANK" >> "$LOG"; exit 143' TERM
echo "start $NODE_RANK $*" >> "$LOG"
[ -n "${TASK_EXIT:-}" ] && exit "$TASK_EXIT"
while true; do sleep 0.1; done
"""


def _slurm_stand_ins(tmp_path: Path) -> tuple[dict, Path]:
    """A PATH with the concurrent srun and a recording scontrol, a repository whose launch.sh is the stand-in
    rank, and the log they all write."""
    bin_dir, repo, log = tmp_path / "bin", tmp_path / "repo", tmp_path / "log"
    (repo / "scripts").mkdir(parents=True)
    bin_dir.mkdir()
    for path, text in ((bin_dir / "srun", SRUN_CONCURRENT), (bin_dir / "scontrol", SCONTROL_RECORDING),
                       (repo / "scripts" / "launch.sh", FAKE_LAUNCH)):
        path.write_text(text)
        path.chmod(0o755)
    env = _env(tmp_path, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_NNODES="2", LOG=str(log),
               SLURM_JOB_NODELIST="gpu-a[17-18]", SLURM_JOB_ID="4242", SLURM_CPUS_PER_TASK="64",
               MEGAFLOW_REPO=str(repo))
    return env, log


def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.is_file() else []


def test_sbatch_time_limit_signal_checkpoints_every_rank_then_requeues(tmp_path):
    """SLURM's USR1 ahead of the time limit (--signal=B:USR1@...): every rank gets SIGTERM and checkpoints, the
    batch script waits for them, requeues the job itself and exits 0; srun gets the CPUs explicitly."""
    import signal
    import time
    assert "#SBATCH --signal=B:USR1@" in SBATCH.read_text() and "#SBATCH --requeue" in SBATCH.read_text()
    env, log = _slurm_stand_ins(tmp_path)
    proc = subprocess.Popen(["bash", str(SBATCH), "-c", "x.toml"], cwd=tmp_path, env=env, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 30
    while sum(x.startswith("start") for x in _lines(log)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=60)
    lines = _lines(log)
    assert proc.returncode == 0, err
    assert sorted(x for x in lines if x.startswith(("start", "checkpoint"))) == [
        "checkpoint 0", "checkpoint 1", "start 0 --resume auto -c x.toml", "start 1 --resume auto -c x.toml"], lines
    assert lines[-1] == "requeue 4242" and lines.count("requeue 4242") == 1, lines
    assert "srun --cpus-per-task=64" in lines, lines


def test_sbatch_without_the_signal_does_not_requeue(tmp_path):
    """A run that ends by itself (0) or fails (1) ends the job with that code; nothing is requeued. A job id that
    is not a number is refused before anything runs (it would be run by shell arithmetic)."""
    env, log = _slurm_stand_ins(tmp_path)
    for code in (0, 1):
        r = subprocess.run(["bash", str(SBATCH)], cwd=tmp_path, env={**env, "TASK_EXIT": str(code)},
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == code, r.stderr
    assert not any(x.startswith("requeue") for x in _lines(log))
    marker = tmp_path / "ran"
    r = subprocess.run(["bash", str(SBATCH)], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**env, "SLURM_JOB_ID": f"a[$(touch {marker})]"})
    assert r.returncode == 2 and "SLURM_JOB_ID must be a number" in r.stderr and not marker.exists(), r.stderr


LAUNCH_REFUSALS = {  # the variables' values launch.sh refuses before torchrun starts (one line, exit 2)
    "NNODES with a shell separator": ({"NNODES": "2;x"}, "launch.sh: NNODES=2\\;x: want a whole number >= 1"),
    "NODE_RANK beyond NNODES": ({"NNODES": "2", "NODE_RANK": "2"},
                                "launch.sh: NODE_RANK=2 is beyond NNODES=2 (node ranks are 0 .. 1)"),
    "NODE_RANK beyond the default NNODES": ({"NODE_RANK": "1"}, "NODE_RANK=1 is beyond NNODES=1"),
    "NODE_RANK negative": ({"NODE_RANK": "-1"}, "NODE_RANK=-1: want a whole number >= 0"),
    "NNODES 0": ({"NNODES": "0"}, "NNODES=0: want a whole number >= 1"),
    "NNODES of 20 digits": ({"NNODES": "9" * 20}, f"NNODES={'9' * 20}: want a whole number"),
    "NPROC a word": ({"NPROC": "eight"}, "NPROC=eight: want a whole number >= 1"),
    "MASTER_PORT beyond 65535": ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000: want a TCP port, 1 .. 65535"),
    "SHUTDOWN_TIMEOUT a float": ({"SHUTDOWN_TIMEOUT": "1.5"}, "SHUTDOWN_TIMEOUT=1.5: want a whole number >= 0"),
    "MASTER_ADDR with a space": ({"MASTER_ADDR": "node0 --x"}, "MASTER_ADDR=node0\\ --x: want a host name"),
}


@pytest.mark.parametrize("name", sorted(LAUNCH_REFUSALS))
def test_launch_refuses_a_malformed_variable_in_one_line(name, tmp_path):
    env, needle = LAUNCH_REFUSALS[name]
    # VENV points nowhere: a refusal comes before the venv is looked for or anything starts
    r = subprocess.run(["bash", str(LAUNCH), "-c", "configs/cpu_demo.toml"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, env=_env(tmp_path, **env, VENV=str(tmp_path / "no-venv"), DRY_RUN="0"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and needle in r.stderr and r.stdout == "", r.stderr
