"""A tiny ``megaflow train`` on configs/cpu_demo.toml with a test's own reward module (for tests/run)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def train_with_reward(tmp: Path, name: str, reward: str, extra: list[str]) -> tuple[list[str], dict]:
    """(command, environment) of a 1-prompt, 2-sample, 2-step ``megaflow train`` named ``name`` under
    ``tmp/runs`` whose only reward is ``reward`` ('module:fn' importable from ``tmp``), plus ``extra`` sets."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp)]), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    sets = [f'run.name="{name}"', f'run.output_dir="{tmp / "runs"}"', f'reward.weights={{"{reward}" = 1.0}}',
            "reward.kwargs={}", "rollout.prompts_per_iter=1", "rollout.group_size=2", "rollout.num_steps=2",
            "rollout.height=32", "rollout.width=32", "train.micro_batch_size=2", *extra]
    cmd = [sys.executable, "-m", "megaflow.cli", "train", "-c", str(REPO / "configs" / "cpu_demo.toml")]
    for s in sets:
        cmd += ["--set", s]
    return cmd, env
