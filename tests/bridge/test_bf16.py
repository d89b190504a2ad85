"""bf16 end to end: model.dtype = "bfloat16" (megatron bf16 params, fp32 main params in the optimizer) with
rollout.precision = "bf16" (the SGLang engine's DiT in bf16) and bridge.verify = true passes preflight, and
every sync should verify: the bridge hashes the trainer's tensors, bf16 except SD3's position table, which
the trainer (megaflow.models.sd3.model.PatchEmbed), diffusers and the SGLang engine all keep in fp32; the
engine stores each in its own dtype and re-hashes the same bytes. Mixed dtypes under verify stay refused by
preflight (they could never match).

Regression: ``SGLangEngine.update_weights`` once cast every tensor to ``rollout.precision`` before sending,
turning the fp32 position table into bf16; the engine's re-hash of fp32(bf16(table)) never matched the
trainer's fp32 digest ("checksum mismatch for 1 tensor(s): pos_embed.pos_embed").

Needs: CPU, 1 process with one SGLang engine (~25 s start).
"""
from __future__ import annotations

import pytest

from megaflow.config import ConfigError, load_config
from megaflow.config.preflight import preflight
from megaflow.testing.dist import run_multiprocess

import bf16_workers


def test_preflight_accepts_matching_bf16_and_refuses_mixed_under_verify():
    preflight(load_config(None, ["model.dtype=bfloat16", "rollout.precision=bf16"]), "show")
    for dtype, precision in (("bfloat16", "fp32"), ("float32", "bf16")):
        with pytest.raises(ConfigError, match="rollout.precision"):
            preflight(load_config(None, [f"model.dtype={dtype}", f"rollout.precision={precision}"]), "show")
        preflight(load_config(None, [f"model.dtype={dtype}", f"rollout.precision={precision}",
                                     "bridge.verify=false"]), "show")


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.engine
def test_bf16_trainer_syncs_verified_into_bf16_engine(tiny_sd3_dir):
    (r,) = run_multiprocess(bf16_workers.bf16_sync_rank, 1, str(tiny_sd3_dir), timeout_s=600)
    print(r)
    assert r["first_verified"] and r["second_verified"] and r["num_tensors"] > 10
    assert r["update_ok"] and r["moved"] > 0
    assert r["param_dtypes"] == ["torch.bfloat16"] and r["main_dtypes"] == ["torch.float32"]
    assert r["ref_dtypes"] == ["torch.bfloat16"] and r["sent_dtypes"] == ["torch.bfloat16", "torch.float32"]
