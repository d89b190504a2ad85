"""logging.wandb: the wandb mode comes from the environment (WANDB_MODE, else online with WANDB_API_KEY, else
offline) and reaches wandb.init. Needs: CPU, 1 process, no network (a stand-in wandb module records calls)."""
from __future__ import annotations

import sys
import types

import pytest

from megaflow.report.metrics import MetricsLog, wandb_mode


@pytest.mark.parametrize("env, mode", [
    ({}, "offline"),
    ({"WANDB_API_KEY": "k"}, "online"),
    ({"WANDB_MODE": "disabled", "WANDB_API_KEY": "k"}, "disabled"),
    ({"WANDB_MODE": "offline", "WANDB_API_KEY": "k"}, "offline"),
    ({"WANDB_MODE": "online"}, "online"),
    ({"WANDB_MODE": "", "WANDB_API_KEY": ""}, "offline"),
])
def test_wandb_mode_from_environment(env, mode):
    assert wandb_mode(env) == mode


def test_metrics_log_initialises_wandb_with_that_mode(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "k")
    log = MetricsLog(tmp_path / "run", wandb=True)
    log.write(1, {"reward/total": 0.5, "note": "x"})
    log.close()
    assert calls[0][0] == "init" and calls[0][1]["mode"] == "online" and calls[0][1]["project"] == "megaflow"
    assert calls[1] == ("log", 1, {"reward/total": 0.5}) and calls[2] == ("finish",)
    monkeypatch.delenv("WANDB_API_KEY")
    MetricsLog(tmp_path / "run2", wandb=True).close()
    assert calls[3][1]["mode"] == "offline"
