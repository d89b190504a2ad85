"""`megaflow export --max-shard-size` and `--lora-only`.

Needs: CPU, 1 gloo rank per hand-made run (as tests/run/test_export.py: a tiny SD3 pipeline, checkpoint 3 saved
from the run's Trainer after 2 Adam steps). Checks: a transformer over the shard size is written as diffusers
writes shards (``-0000k-of-0000N`` files + index.json), diffusers' SD3Transformer2DModel.from_pretrained loads it
and its tensors equal the single-file export's bit for bit; ``--lora-only`` on a LoRA run writes exactly the
adapter (tensors equal to the full export's adapter) and a README.md naming the base pipeline, rank, alpha and
targets, and diffusers loads the adapter onto the base; a full-parameter run is refused with one line.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megaflow import cli
from megaflow.config import load_config, save_config
from megaflow.commands.export import parse_size

ITERATION = 3


def _hand_made_run(root: Path, *overrides: str) -> Path:
    from megaflow.models.tiny_pipeline import make_tiny_pipeline
    from megaflow.testing.dist import run_multiprocess

    import export_workers

    run_dir = root / "run"
    pipeline = make_tiny_pipeline("sd3", run_dir / "tiny-pipeline", seed=0)
    save_config(load_config(None, ["train.lr=1e-3", *overrides]), run_dir)
    run_multiprocess(export_workers.train_and_checkpoint, 1, str(run_dir), str(pipeline), ITERATION, 2,
                     timeout_s=600)
    return run_dir


def _export(capsys, *argv) -> tuple[int, list[str], str]:
    rc = cli.main(["export", *map(str, argv)])
    out = capsys.readouterr()
    return rc, [x for x in out.err.splitlines() if x.startswith("megaflow:")], out.out


@pytest.mark.parametrize("text, size", [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("100KB", 10**5),
                                        ("2GiB", 2 * 2**30), ("1.5 gb", 15 * 10**8), ("4096", 4096), (7, 7)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "5XB", "GB", "-1MB", "0", "five", "inf", "nanGB", True])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError, match="--max-shard-size"):
        parse_size(text)


@pytest.mark.slow
@pytest.mark.dist
def test_sharded_export_loads_in_diffusers_bit_for_bit(tmp_path, capsys):
    from diffusers import SD3Transformer2DModel
    from safetensors.torch import load_file

    run_dir = _hand_made_run(tmp_path)
    rc, err, _ = _export(capsys, "--run", run_dir, "--out", tmp_path / "single")
    assert (rc, err) == (0, [])
    single = tmp_path / "single" / "transformer"
    size = (single / "diffusion_pytorch_model.safetensors").stat().st_size
    assert size > 4 * 100_000, size  # so 100KB makes several shards
    rc, err, printed = _export(capsys, "--run", run_dir, "--out", tmp_path / "sharded", "--max-shard-size", "100KB",
                               "--json")
    assert (rc, err) == (0, [])
    t = tmp_path / "sharded" / "transformer"
    index = json.loads((t / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in t.glob("diffusion_pytorch_model-*.safetensors"))
    n = len(shards)
    assert n >= 4 and shards == [f"diffusion_pytorch_model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (t / "diffusion_pytorch_model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == shards
    assert json.loads(printed)["transformer_files"] == [*shards, "diffusion_pytorch_model.safetensors.index.json"]
    reference = load_file(str(single / "diffusion_pytorch_model.safetensors"))
    assert sorted(index["weight_map"]) == sorted(reference)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in reference.values())

    got = SD3Transformer2DModel.from_pretrained(t).state_dict()
    want = SD3Transformer2DModel.from_pretrained(single).state_dict()
    assert sorted(got) == sorted(want) == sorted(reference)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    assert [k for k in want if not torch.equal(want[k], reference[k])] == []

    rc, err, _ = _export(capsys, "--run", run_dir, "--out", tmp_path / "x", "--lora-only")
    assert rc == 2 and len(err) == 1 and "full-parameter run (lora.rank = 0)" in err[0]
    rc, err, _ = _export(capsys, "--run", run_dir, "--out", tmp_path / "x", "--max-shard-size", "lots")
    assert rc == 2 and len(err) == 1 and "--max-shard-size 'lots'" in err[0]
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.tmp-*"))


@pytest.mark.slow
@pytest.mark.dist
def test_lora_only_export(tmp_path, capsys):
    from diffusers import StableDiffusion3Pipeline
    from safetensors.torch import load_file

    run_dir = _hand_made_run(tmp_path, "lora.rank=4", "lora.alpha=8.0", 'lora.targets=["linear_qkv", "linear_proj"]')
    pipeline = run_dir / "tiny-pipeline"
    rc, err, printed = _export(capsys, "--run", run_dir, "--out", tmp_path / "lora", "--lora-only", "--json")
    assert (rc, err) == (0, [])
    out = tmp_path / "lora"
    encoder = ["encode_prompts.py"] if (pipeline / "megaflow.json").is_file() else []  # an SD3 prompt length
    assert sorted(p.name for p in out.iterdir()) == sorted(["README.md", *encoder, "pytorch_lora_weights.safetensors",
                                                            "adapter_config.json", "adapter_model.safetensors"])
    assert json.loads(printed)["lora_tensors"] > 0
    card = (out / "README.md").read_text()
    assert card.startswith("---\nbase_model: tiny-pipeline\n") and str(tmp_path) not in card  # no machine path
    assert "rank 4" in card and "alpha 8" in card and "linear_qkv, linear_proj" in card
    assert f"iteration {ITERATION}" in card

    rc, err, _ = _export(capsys, "--run", run_dir, "--out", tmp_path / "full")
    assert (rc, err) == (0, [])
    adapter = load_file(str(out / "pytorch_lora_weights.safetensors"))
    full = load_file(str(tmp_path / "full" / "pytorch_lora_weights.safetensors"))
    assert sorted(adapter) == sorted(full) and all(torch.equal(adapter[k], full[k]) for k in full)
    assert any(k.endswith("lora_B.weight") and adapter[k].abs().max() > 0 for k in adapter)  # trained, not B = 0

    pipe = StableDiffusion3Pipeline.from_pretrained(pipeline)
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    pipe.load_lora_weights(out, weight_name="pytorch_lora_weights.safetensors")
    loaded = {k: v for k, v in pipe.transformer.state_dict().items() if "lora_B" in k}
    assert loaded and not set(before) & set(loaded)
