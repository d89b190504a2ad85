"""LoRA in and out: a PEFT adapter made elsewhere (peft on the diffusers transformer) starts a LoRA run
(``lora.init``), the run's checkpoint resumes exactly (adapters + optimizer state), and `megaflow export`
writes the adapter in the diffusers/PEFT format that ``pipeline.load_lora_weights`` loads.

Needs: CPU, 1 gloo rank (dist checkpointing), diffusers + peft in the parent. Tolerances: trainer velocity vs
diffusers + the same adapter <= 1e-5 (before training: the PEFT adapter; after: the exported one); a resumed
step vs the uninterrupted one: loss and adapters <= 1e-6.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from megaflow import cli
from megaflow.config import load_config, save_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
import lora_workers  # noqa: E402  (the diffusers + PEFT reference)

ITERATION = 3


def _diffusers_velocity(transformer, probe) -> torch.Tensor:
    from megaflow.models.sd3 import tiny
    with torch.no_grad():
        return tiny.diffusers_velocity(transformer, probe["latents"], probe["sigma"], probe["encoder_hidden_states"],
                                       probe["pooled_projections"])


@pytest.mark.slow
@pytest.mark.dist
def test_peft_adapter_in_train_resume_export_out(tmp_path):
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
    from peft import LoraConfig, get_peft_model_state_dict

    from megaflow.models.tiny_pipeline import make_tiny_pipeline
    from megaflow.testing.dist import run_multiprocess

    import lora_export_workers

    torch.set_num_threads(1)
    run_dir = tmp_path / "runs" / "lora"
    pipeline = make_tiny_pipeline("sd3", run_dir / "tiny-pipeline", seed=0)
    # an adapter trained elsewhere: peft on the diffusers transformer, A and B random
    transformer = SD3Transformer2DModel.from_pretrained(pipeline / "transformer").eval()
    transformer.add_adapter(LoraConfig(r=lora_workers.RANK, lora_alpha=lora_workers.ALPHA,
                                       target_modules=lora_workers.PEFT_TARGETS, init_lora_weights=True))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in transformer.named_parameters():
            if "lora_" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    StableDiffusion3Pipeline.save_lora_weights(
        tmp_path / "peft", transformer_lora_layers=get_peft_model_state_dict(transformer),
        transformer_lora_adapter_metadata={"r": lora_workers.RANK, "lora_alpha": lora_workers.ALPHA})
    dconfig = json.loads((pipeline / "transformer" / "config.json").read_text())
    gen = torch.Generator().manual_seed(9)
    probe = dict(latents=torch.randn(2, dconfig["in_channels"], 8, 8, generator=gen), sigma=torch.tensor([0.3, 0.8]),
                 encoder_hidden_states=torch.randn(2, 6, dconfig["joint_attention_dim"], generator=gen),
                 pooled_projections=torch.randn(2, dconfig["pooled_projection_dim"], generator=gen))
    torch.save(probe, tmp_path / "probe.pt")
    cfg = load_config(None, ["train.lr=1e-3", "algo.kl_beta=0.04", f"lora.rank={lora_workers.RANK}",
                             f"lora.alpha={lora_workers.ALPHA}", f"lora.init={tmp_path / 'peft'}"])
    save_config(cfg, run_dir)

    [r] = run_multiprocess(lora_export_workers.lora_run_rank, 1, str(run_dir), str(pipeline), ITERATION, 2,
                           str(tmp_path / "probe.pt"), timeout_s=600)
    assert r["reference"] == "BaseReference"  # KL on: the trainer with its adapters off, no second model
    assert (r["v_init"] - _diffusers_velocity(transformer, probe)).abs().max() <= 1e-5
    assert (r["v_trained"] - r["v_init"]).abs().max() > 1e-3  # training moved the adapters
    assert abs(r["resumed_loss"] - r["next_loss"]) <= 1e-6 and r["adapter_err"] <= 1e-6
    assert torch.equal(r["v_resumed"], r["v_trained"])

    out = tmp_path / "export"
    assert cli.main(["export", "--run", str(run_dir), "--out", str(out)]) == 0
    pipe = StableDiffusion3Pipeline.from_pretrained(out)
    base = _diffusers_velocity(pipe.transformer, probe)
    pipe.load_lora_weights(out, weight_name="pytorch_lora_weights.safetensors")  # offline: name it
    got = _diffusers_velocity(pipe.transformer, probe)
    assert (got - r["v_trained"]).abs().max() <= 1e-5
    assert (base - r["v_trained"]).abs().max() > 1e-3  # the adapter carries the training
    # the same adapter as a PEFT directory: PeftModel on the exported base gives the trained velocity
    from peft import PeftModel
    peft_model = PeftModel.from_pretrained(SD3Transformer2DModel.from_pretrained(out / "transformer"), out)
    assert (_diffusers_velocity(peft_model.get_base_model(), probe) - r["v_trained"]).abs().max() <= 1e-5
    card = (out / "README.md").read_text()  # the export's own card, from the run (not the base pipeline's)
    assert card.startswith("---\n") and "base_model: tiny-pipeline" in card and "flowgrpo" in card, card
    assert "checkpoint iteration 3" in card and "LoRA rank" in card and "adapter_config.json" in card, card
