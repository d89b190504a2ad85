"""tools/convert_checkpoint.py on a tiny Qwen-Image transformer: diffusers -> megatron dist checkpoint
(TP=2) -> diffusers is bit-exact, and the checkpoint loaded at PP=2 gives diffusers' velocity.

Needs: CPU; 2 gloo processes for to-megatron and 2 more for the PP=2 load (slow/dist); diffusers in the
parent. Tolerances: weights and config exact; velocity vs diffusers <= 1e-5 (abs).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megaflow.models.qwen_image import tiny

_spec = importlib.util.spec_from_file_location(
    "convert_checkpoint", Path(__file__).resolve().parents[2] / "tools" / "convert_checkpoint.py")
convert = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert)


@pytest.mark.slow
@pytest.mark.dist
def test_qwen_image_roundtrip_bit_exact_and_pp_load(tmp_path, capsys):
    from diffusers import QwenImageTransformer2DModel

    from megaflow.testing.dist import run_multiprocess

    import convert_workers

    torch.set_num_threads(1)
    src, mg, back = tmp_path / "transformer", tmp_path / "mg_tp2", tmp_path / "back"
    tiny.diffusers_model(tiny.tiny_config(), seed=5).save_pretrained(src)
    assert convert.main(["to-megatron", "--src", str(src), "--dst", str(mg), "--tp", "2"]) == 0
    assert convert.main(["to-diffusers", "--src", str(mg), "--dst", str(back)]) == 0
    assert "error:" not in capsys.readouterr().err
    original = load_file(src / "diffusion_pytorch_model.safetensors")
    converted = load_file(back / "diffusion_pytorch_model.safetensors")
    assert original.keys() == converted.keys() and all(torch.equal(original[k], converted[k]) for k in original)
    src_cfg, back_cfg = (json.loads((d / "config.json").read_text()) for d in (src, back))
    assert {k: v for k, v in src_cfg.items() if not k.startswith("_")} == \
        {k: v for k, v in back_cfg.items() if not k.startswith("_")}
    assert back_cfg["_class_name"] == "QwenImageTransformer2DModel"

    model = QwenImageTransformer2DModel.from_pretrained(src).eval()
    b = tiny.sft_batches(src_cfg, num_microbatches=1)[0]
    x = b["x0"]
    torch.save({"latents": x, "sigma": b["sigma"], "encoder_hidden_states": b["encoder_hidden_states"],
                "encoder_hidden_states_mask": b["encoder_hidden_states_mask"], "img_shapes": b["img_shapes"]},
               tmp_path / "mb.pt")
    with torch.no_grad():
        ref = tiny.diffusers_velocity(model, b, latents=x)
    outs = run_multiprocess(convert_workers.load_and_forward, 2, str(mg), dict(pp=2), str(tmp_path / "mb.pt"))
    assert outs[0] is None and outs[1] is not None
    assert float((outs[1] - ref).abs().max()) <= 1e-5
