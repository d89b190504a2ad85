"""The ``encode_prompts.py`` an SD3 export carries (megaflow.commands.export: a copy of megaflow/models/sd3/text.py) is
usable without megaflow: imported from its own file in a process where ``megaflow`` and ``megatron`` cannot be
imported, it encodes prompts for the shipped ShapeEval pipeline exactly (bit for bit) as megaflow's own
``encode_prompts`` does; and the export decides to write it from the pipeline's megaflow.json. Needs: CPU, 1 process
plus one subprocess (~20 s: diffusers loads the tiny pipeline twice)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from megaflow.commands.export import _ENCODER_SOURCE, ENCODER_FILE, prompt_length

REPO = Path(__file__).resolve().parents[2]
PIPELINE = REPO / "assets" / "shapeeval-sd3"
PROMPTS = ["a red circle", "two blue squares above a green triangle"]
STANDALONE = """
import importlib.abc, sys
class NoMegaflow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("megaflow", "megatron"):
            raise ImportError(f"{name} is not importable here")
sys.meta_path.insert(0, NoMegaflow())
sys.path.insert(0, sys.argv[1])
import torch
from diffusers import StableDiffusion3Pipeline
from encode_prompts import encode_prompts
pipe = StableDiffusion3Pipeline.from_pretrained(sys.argv[2])
embeds, pooled = encode_prompts(pipe, sys.argv[4:], max_sequence_length=int(sys.argv[3]))
torch.save({"embeds": embeds, "pooled": pooled}, sys.argv[1] + "/out.pt")
print(sorted(m for m in sys.modules if m.split(".")[0] in ("megaflow", "megatron")))
"""


def test_exported_encoder_runs_without_megaflow(tmp_path):
    from diffusers import StableDiffusion3Pipeline

    from megaflow.models.sd3.text import encode_prompts
    length = prompt_length(PIPELINE)
    assert length == json.loads((PIPELINE / "megaflow.json").read_text())["max_sequence_length"] == 12
    shutil.copyfile(_ENCODER_SOURCE, tmp_path / ENCODER_FILE)
    r = subprocess.run([sys.executable, "-c", STANDALONE, str(tmp_path), str(PIPELINE), str(length), *PROMPTS],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin",
                                                                                      "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "[]", r.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        embeds, pooled = encode_prompts(StableDiffusion3Pipeline.from_pretrained(PIPELINE), PROMPTS,
                                        max_sequence_length=length)
    assert torch.equal(got["embeds"], embeds) and torch.equal(got["pooled"], pooled)
    assert embeds.shape[:2] == (2, 2 * length)


def test_encoder_written_only_for_an_sd3_prompt_length(tmp_path):
    pipe = tmp_path / "p"
    pipe.mkdir()
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    (pipe / "megaflow.json").write_text(json.dumps({"max_sequence_length": 12}))
    assert prompt_length(pipe) is None
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    assert prompt_length(pipe) == 12
    (pipe / "megaflow.json").unlink()
    assert prompt_length(pipe) is None
