"""The [lora] section: preflight refuses what the LoRA path cannot do before anything heavy runs, its target
table equals the model code's, and the shipped LoRA demo config passes. Needs: CPU, 1 process."""
from __future__ import annotations

from pathlib import Path

import pytest

from megaflow.config import ConfigError, load_config
from megaflow.config import preflight as pf

REPO = Path(__file__).resolve().parents[2]


def test_target_table_equals_the_model_code():
    from megaflow.models.common.lora import TARGETS
    assert pf.LORA_TARGETS == TARGETS
    assert load_config(None).lora.targets == list(TARGETS)


@pytest.mark.parametrize("overrides, message", [
    (["lora.rank=4", "lora.targets=['to_q']"], "lora.targets"),
    (["lora.rank=4", "bridge.mode='disk'"], "bridge.mode"),
    (["lora.rank=4", "lora.init='no/such/adapter'"], "lora.init"),
    (["lora.init='no/such/adapter'"], "lora.rank > 0"),
])
def test_preflight_refuses(overrides, message, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=message):
        pf.preflight(load_config(None, overrides), "train")


def test_preflight_reads_the_lora_init_header(tmp_path, monkeypatch):
    """A lora.init that is no safetensors file (here a text file, and a truncated adapter in a directory) is one
    line naming lora.init and the file, before any weights are read."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    text = tmp_path / "adapter.safetensors"
    text.write_text("not weights\n")
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "pytorch_lora_weights.safetensors").write_bytes(b"\x10\x00")
    for init, what in ((text, "corrupt or truncated"), (folder, "truncated")):
        with pytest.raises(ConfigError, match=rf"lora.init: .*{what}") as err:
            pf.preflight(load_config(None, ["lora.rank=4", f"lora.init='{init}'"]), "train")
        assert "\n" not in str(err.value)


def test_shipped_lora_demo_config_passes(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_config(REPO / "configs" / "shapes_demo_lora.toml")
    assert cfg.lora.rank > 0 and pf.preflight(cfg, "demo") is cfg
