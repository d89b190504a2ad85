"""tools/convert_checkpoint.py: diffusers <-> megatron dist checkpoint.

Needs: CPU; the round trip launches 2 gloo processes (to-megatron at TP=2) and then 2 more
(loading that checkpoint at TP1xPP2), so it is marked slow/dist. The error cases run in-process
without any launch: each must exit 2 with ONE stderr line naming the problem and write nothing.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megaflow.models.sd3 import tiny

_spec = importlib.util.spec_from_file_location(
    "convert_checkpoint", Path(__file__).resolve().parents[2] / "tools" / "convert_checkpoint.py")
convert = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert)


@pytest.fixture(scope="module")
def src_dir(tmp_path_factory):
    """A tiny SD3.5-style diffusers transformer dir (config.json + safetensors), random weights."""
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("conv") / "transformer"
    tiny.diffusers_model(tiny.tiny_config(qk_norm="rms_norm", dual_attention_layers=(0,)), seed=5).save_pretrained(path)
    return path


def _run(argv, capsys):
    """(exit code, the tool's "error: ..." lines joined); library warnings on stderr are ignored."""
    rc = convert.main([str(a) for a in argv])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    return rc, "\n".join(lines)


@pytest.mark.slow
@pytest.mark.dist
def test_roundtrip_bit_exact_and_reshard(src_dir, tmp_path, capsys):
    from megaflow.testing.dist import run_multiprocess

    import convert_workers

    mg, back = tmp_path / "mg_tp2", tmp_path / "back"
    assert _run(["to-megatron", "--src", src_dir, "--dst", mg, "--tp", 2], capsys) == (0, "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mg_tp2"]  # no temp dir left behind
    assert _run(["to-diffusers", "--src", mg, "--dst", back], capsys) == (0, "")
    original, converted = load_file(src_dir / "diffusion_pytorch_model.safetensors"), load_file(back / "diffusion_pytorch_model.safetensors")
    assert original.keys() == converted.keys()
    assert all(torch.equal(original[k], converted[k]) for k in original)
    src_cfg, back_cfg = json.loads((src_dir / "config.json").read_text()), json.loads((back / "config.json").read_text())
    for key in ("num_layers", "qk_norm", "dual_attention_layers", "num_attention_heads", "pos_embed_max_size"):
        assert src_cfg[key] == back_cfg[key]

    # The TP=2 checkpoint loads at TP1xPP2 and gives the diffusers model's output.
    from diffusers import SD3Transformer2DModel

    model = SD3Transformer2DModel.from_pretrained(src_dir).eval()
    b = tiny.sft_batches(src_cfg, num_microbatches=1)[0]
    batch = dict(latents=b["x0"], sigma=b["sigma"], encoder_hidden_states=b["encoder_hidden_states"],
                 pooled_projections=b["pooled_projections"])
    torch.save(batch, tmp_path / "batch.pt")
    with torch.no_grad():
        ref = tiny.diffusers_velocity(model, **batch)
    outs = run_multiprocess(convert_workers.load_and_velocity, 2, str(mg), dict(pp=2), str(tmp_path / "batch.pt"))
    assert outs[0] is None and outs[1] is not None
    assert float((outs[1] - ref).abs().max()) <= 1e-5


def test_errors_one_line_nothing_written(src_dir, tmp_path, capsys):
    dst = tmp_path / "out"
    rc, err = _run(["to-megatron", "--src", tmp_path / "nope", "--dst", dst], capsys)
    assert rc == 2 and "nope" in err and len(err.splitlines()) == 1

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((src_dir / "config.json").read_text())
    rc, err = _run(["to-megatron", "--src", bad, "--dst", dst], capsys)  # weights file missing
    assert rc == 2 and "diffusion_pytorch_model.safetensors" in err and len(err.splitlines()) == 1

    state = load_file(src_dir / "diffusion_pytorch_model.safetensors")
    state["transformer_blocks.1.attn.to_k.weight"] = state["transformer_blocks.1.attn.to_k.weight"][:, :-1].contiguous()
    save_file(state, bad / "diffusion_pytorch_model.safetensors")
    rc, err = _run(["to-megatron", "--src", bad, "--dst", dst], capsys)
    assert rc == 2 and "transformer_blocks.1.attn.to_k.weight" in err and len(err.splitlines()) == 1

    cfg = json.loads((src_dir / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "_class_name": "FluxTransformer2DModel"}))
    rc, err = _run(["to-megatron", "--src", bad, "--dst", dst], capsys)
    assert rc == 2 and "FluxTransformer2DModel" in err and len(err.splitlines()) == 1

    (bad / "config.json").write_text(json.dumps({**cfg, "num_layers": 3}))  # weights have 4 blocks
    save_file(load_file(src_dir / "diffusion_pytorch_model.safetensors"), bad / "diffusion_pytorch_model.safetensors")
    rc, err = _run(["to-megatron", "--src", bad, "--dst", dst], capsys)
    assert rc == 2 and "transformer_blocks.2.norm1_context" in err and len(err.splitlines()) == 1  # now the last block

    rc, err = _run(["to-diffusers", "--src", src_dir, "--dst", dst], capsys)  # not a megatron ckpt
    assert rc == 2 and "megaflow_model.json" in err and len(err.splitlines()) == 1

    dst.mkdir()
    rc, err = _run(["to-megatron", "--src", src_dir, "--dst", dst], capsys)
    assert rc == 2 and "already exists" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "nope", "out"] or sorted(
        p.name for p in tmp_path.iterdir()) == ["bad", "out"]


@pytest.mark.slow
@pytest.mark.dist
def test_wan_roundtrip_bit_exact(tmp_path, capsys):
    """A tiny Wan text-to-video transformer through to-megatron at TP=2 (its q/k norm scales split by heads)
    and back: every tensor bit-exact, the config's keys equal."""
    from megaflow.models.wan import tiny as wan_tiny

    torch.set_num_threads(1)
    src = tmp_path / "wan"
    wan_tiny.diffusers_model(wan_tiny.tiny_config(), seed=7).save_pretrained(src)
    mg, back = tmp_path / "wan_tp2", tmp_path / "wan_back"
    assert _run(["to-megatron", "--src", src, "--dst", mg, "--tp", 2], capsys) == (0, "")
    assert _run(["to-diffusers", "--src", mg, "--dst", back], capsys) == (0, "")
    original, converted = load_file(src / "diffusion_pytorch_model.safetensors"), load_file(back / "diffusion_pytorch_model.safetensors")
    assert original.keys() == converted.keys()
    assert all(torch.equal(original[k], converted[k]) for k in original)
    src_cfg, back_cfg = json.loads((src / "config.json").read_text()), json.loads((back / "config.json").read_text())
    assert {k: v for k, v in src_cfg.items() if not k.startswith("_")} == \
        {k: v for k, v in back_cfg.items() if not k.startswith("_")}
    assert back_cfg["_class_name"] == "WanTransformer3DModel"
