"""One trust rule for every path that reads a checkpoint (megaflow.trainer.dcp_metadata): ``megaflow export``,
``tools/convert_checkpoint.py to-diffusers`` and ``--resume`` (megaflow.run.state.load). Each crafted case of
tests/run/crafted_checkpoints.py -- a ``__reduce__`` payload in ``model/.metadata``, absolute and ``../`` storage
paths, an offset of 10**18, a length of 10**15, a byte item on /dev/zero of 2**36 bytes, ``size="abc"``,
``chunks=None``, a truncated ``.distcp``, a state.json with ``iteration="4"`` or a negative ``prompts_consumed`` --
is written over a copy of one real checkpoint and resealed with megaflow's own manifest writer; each reader must
refuse it with exit 2 (a ValueError for the resume), one line naming the problem, no traceback, nothing written,
and the payload never runs. The same readers on the untouched checkpoint give the trainer's weights (reference:
the trainer that saved it; tolerance 0).

The checkpoint is megaflow.run.state.save's, from a Trainer with its optimizer built in this process on a
1-rank gloo group: no engine, no launch (~15 s once per module). Needs: CPU, 1 process."""
from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

import pytest
import torch

from crafted_checkpoints import CRAFTS, STATE_CRAFTS, checkpoint_of, crafted_copy, save_run_checkpoint
from megaflow import cli

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("convert_checkpoint", REPO / "tools" / "convert_checkpoint.py")
convert = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(run dir, the trainer that saved its checkpoint, its weights by engine name)."""
    from megaflow.bridge.convert import engine_named_params
    from megaflow.parallel.distributed import destroy_distributed

    torch.set_num_threads(1)
    run_dir, trainer = save_run_checkpoint(tmp_path_factory.mktemp("trust"))
    weights = {k: v.detach().clone() for k, v in engine_named_params(trainer)}
    yield run_dir, trainer, weights
    destroy_distributed()


class _Untouchable:
    """A trainer that fails the test if the resume touches it before the checkpoint is refused."""

    def __getattr__(self, name):
        raise AssertionError(f"the resume used the trainer ({name}) before refusing the checkpoint")


def _hashes(root: Path) -> dict[str, str]:
    out = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(top) / name
            out[str(p.relative_to(root))] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _lines(err: str, prefix: str) -> list[str]:
    assert "Traceback" not in err, err[-2000:]
    return [line for line in err.splitlines() if line.startswith(prefix)]


def _export(run_dir: Path, out: Path, capsys) -> tuple[int, list[str]]:
    rc = cli.main(["export", "--run", str(run_dir), "--out", str(out), "--no-ema"])
    return rc, _lines(capsys.readouterr().err, "megaflow:")


def _convert(model_dir: Path, out: Path, capsys) -> tuple[int, list[str]]:
    rc = convert.main(["to-diffusers", "--src", str(model_dir), "--dst", str(out)])
    return rc, _lines(capsys.readouterr().err, "error:")


def test_the_untouched_checkpoint_reads_back_the_trainers_weights(saved, tmp_path, capsys):
    from safetensors.torch import load_file

    from megaflow.run import state

    run_dir, trainer, weights = saved
    rc, err = _export(run_dir, tmp_path / "export", capsys)
    assert (rc, err) == (0, [])
    exported = load_file(tmp_path / "export" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert sorted(exported) == sorted(weights) and all(torch.equal(exported[k], weights[k]) for k in weights)
    rc, err = _convert(checkpoint_of(run_dir) / "model", tmp_path / "converted", capsys)
    assert (rc, err) == (0, [])
    converted = load_file(tmp_path / "converted" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(converted[k], weights[k]) for k in weights)
    with torch.no_grad():
        for p in trainer.chunks[0].parameters():
            p.add_(1.0)  # the resume must put every weight back
    loaded = state.load(trainer, checkpoint_of(run_dir))
    assert loaded["iteration"] == 1 and loaded["prompts_consumed"] == 4
    from megaflow.bridge.convert import engine_named_params
    assert all(torch.equal(v, weights[k]) for k, v in engine_named_params(trainer))


READERS = ("export", "convert", "resume")
ROWS = [(name, reader) for name in CRAFTS for reader in READERS if reader == "resume" or name not in STATE_CRAFTS]


@pytest.mark.parametrize("name,reader", ROWS)
def test_a_crafted_checkpoint_is_refused_in_one_line(saved, tmp_path, capsys, name, reader):
    from megaflow.run import state

    run_dir, _, _ = saved
    marker, out = tmp_path / "payload-ran", tmp_path / "out"
    ckpt = crafted_copy(run_dir, tmp_path / "run", name, marker)
    before = _hashes(tmp_path)
    needle = CRAFTS[name][1]
    if reader == "resume":
        with pytest.raises(ValueError) as e:
            state.load(_Untouchable(), ckpt)
        lines = [str(e.value)]
    else:
        rc, lines = (_export(tmp_path / "run", out, capsys) if reader == "export"
                     else _convert(ckpt / "model", out, capsys))
        assert rc == 2, lines
    assert len(lines) == 1 and "\n" not in lines[0] and needle in lines[0], lines
    assert not marker.exists(), "the payload ran"
    assert _hashes(tmp_path) == before, "the reader wrote something"
