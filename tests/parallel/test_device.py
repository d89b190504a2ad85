"""run.device: one switch (megaflow.parallel.distributed.select_device) applied by the commands before CUDA is touched.
Needs: CPU, 1 process (+ short subprocesses). On a GPU machine the "cpu" case checks that CUDA is really hidden."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megaflow.parallel.distributed import current_device, select_device

REPO = Path(__file__).resolve().parents[2]


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_auto_follows_torch():
    assert select_device("auto") == current_device() == torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_cpu_hides_cuda_from_this_process_and_its_children():
    r = _python("import os, subprocess, sys, torch\n"
                "from megaflow.parallel.distributed import select_device\n"
                "d = select_device('cpu')\n"
                "child = subprocess.run([sys.executable, '-c', 'import torch; print(torch.cuda.is_available())'],"
                " capture_output=True, text=True).stdout.strip()\n"
                "print(d, torch.cuda.is_available(), repr(os.environ['CUDA_VISIBLE_DEVICES']), child)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["cpu", "False", "''", "False"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_device_is_one_line_and_exit_2():
    with pytest.raises(ValueError, match="run.device = cuda"):
        select_device("cuda")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "megaflow.cli", "train", "--set", "run.device=cuda"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    # preflight finds it first, before torch is imported (select_device's own check is the second line of defence)
    assert len(lines) == 1 and "run.device = 'cuda'" in lines[0], r.stderr


def test_unknown_choice():
    with pytest.raises(ValueError, match="expected auto, cpu or cuda"):
        select_device("tpu")
