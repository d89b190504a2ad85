"""An engine with ``log_dir`` writes its workers' output to <log_dir>/<engine_id>.log and the terminal stays
quiet (needs: engine; one engine start in a subprocess, ~40 s).

The subprocess's stdout/stderr stand for the terminal. SGLang logs at info, so every call logs its stages
("[DenoisingStage] finished in ...") — in the file, never on the terminal; what the host prints after the
start still reaches the terminal (its descriptors were restored) and not the file.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import logging
    import sys

    if __name__ == "__main__":
        import megaflow  # noqa: F401
        import torch
        from megaflow.rollout.sglang import SGLangEngine, SGLangEngineConfig
        from megaflow.rollout.types import RolloutRequest
        torch.set_num_threads(1)
        logging.basicConfig(level=logging.INFO)
        config = SGLangEngineConfig(model_path=sys.argv[1], log_dir=sys.argv[2], log_level="info", engine_id="e7")
        with SGLangEngine(config) as engine:
            print("megaflow-host: engine started", flush=True)
            logging.getLogger("megaflow.test").warning("megaflow-host: a warning after the start")
            trajs = engine.generate([RolloutRequest(prompt="a red cat", num_outputs=2, seed=1, num_steps=3,
                                                    height=32, width=32)])
            print(f"megaflow-host: generated {len(trajs)}", flush=True)
''')


def test_engine_output_goes_to_its_log_file(tiny_sd3_dir, tmp_path):
    script = tmp_path / "start_engine.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, str(script), str(tiny_sd3_dir), str(tmp_path / "logs")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    terminal = r.stdout + r.stderr
    assert r.returncode == 0, terminal[-4000:]
    log = (tmp_path / "logs" / "e7.log").read_text()
    assert log.count("[DenoisingStage] finished") == 1 and "Starting server" in log  # the call and the start
    assert "Stage]" not in terminal and "server_args" not in terminal, terminal[-4000:]
    assert "megaflow-host: engine started" in r.stdout and "megaflow-host: generated 2" in r.stdout
    assert "megaflow-host: a warning after the start" in r.stderr
    assert "megaflow-host:" not in log
