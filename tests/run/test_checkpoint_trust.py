"""One trust rule for every path that reads a checkpoint (megaflow.trainer.dcp_metadata): ``megaflow export``,
``tools/convert_checkpoint.py to-diffusers`` and ``--resume`` (megaflow.rundir.checkpoint_io.load). Each crafted case of
tests/run/crafted_checkpoints.py -- a ``__reduce__`` payload in ``model/.metadata``, absolute and ``../`` storage
paths, an offset of 10**18, a length of 10**15, a byte item on /dev/zero of 2**36 bytes, ``size="abc"``,
``chunks=None``, a truncated ``.distcp``, top-level fields of ``.metadata`` of the wrong type or missing, a plain
``.pt`` instead of a dist checkpoint, a tensor the model does not have or one of its own resized, on a sparse file
of 256 MiB (refused before anything is allocated), a byte item of 128 MiB on one, a state.json with ``iteration="4"``, a negative ``prompts_consumed``, a numpy
RNG position of 10**30 or a string, a metrics row whose reward is a list -- is written over a copy of one real checkpoint and resealed with megaflow's own manifest writer; each reader must
refuse it with exit 2 (a ValueError for the resume), one line naming the problem, no traceback, nothing written,
and the payload never runs. The same readers on the untouched checkpoint give the trainer's weights (reference:
the trainer that saved it; tolerance 0).

An export while the run rotates the checkpoint out reads the new latest (or, for a named --iteration, says it was
removed and which are kept); an export to a full disk is one NoSpace line, nothing left.

A full disk during the next save (simulated: torch's writer fails as it does on a full disk, or a write of
state.json raises ENOSPC) ends in one line naming the checkpoint and the bytes it needs, leaves no staging or
temporary file, and the previous checkpoint still loads.

The checkpoint is megaflow.rundir.checkpoint_io.save's, from a Trainer with its optimizer built in this process on a
1-rank gloo group: no engine, no launch (~15 s once per module). Needs: CPU, 1 process."""
from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from crafted_checkpoints import CRAFTS, STATE_CRAFTS, WHOLE_MODEL_CRAFTS, checkpoint_of, crafted_copy, save_run_checkpoint
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

    from megaflow.rundir import checkpoint_io

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
    loaded = checkpoint_io.load(trainer, checkpoint_of(run_dir))
    assert loaded["iteration"] == 1 and loaded["prompts_consumed"] == 4
    from megaflow.bridge.convert import engine_named_params
    assert all(torch.equal(v, weights[k]) for k, v in engine_named_params(trainer))


def test_a_save_starts_no_process_and_reads_back(saved, tmp_path):
    """megatron's writer hands its results over in this process (megaflow.trainer.checkpoint): a save starts no
    helper process, and what it wrote loads back."""
    import psutil

    from megaflow.rundir import checkpoint_io

    run_dir, trainer, weights = saved
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    dconfig = json.loads((run_dir / "tiny-pipeline" / "transformer" / "config.json").read_text())
    checkpoint_io.save(trainer, tmp_path, 2, family="sd3", diffusers_config=dconfig, prompts_consumed=0,
               metrics_rows=[{"iteration": 2}], keep=1)
    assert {c.pid for c in psutil.Process().children(recursive=True)} <= before
    assert checkpoint_io.load(trainer, tmp_path / "checkpoints" / "iter_000002")["iteration"] == 2


READERS = ("export", "convert", "resume")
ROWS = [(name, reader) for name in CRAFTS for reader in READERS
        if (reader == "resume" or name not in STATE_CRAFTS) and (reader != "resume" or name not in WHOLE_MODEL_CRAFTS)]


@pytest.mark.parametrize("name,reader", ROWS)
def test_a_crafted_checkpoint_is_refused_in_one_line(saved, tmp_path, capsys, name, reader):
    from megaflow.rundir import checkpoint_io

    run_dir, _, _ = saved
    marker, out = tmp_path / "payload-ran", tmp_path / "out"
    ckpt = crafted_copy(run_dir, tmp_path / "run", name, marker)
    before = _hashes(tmp_path)
    needle = CRAFTS[name][1]
    if reader == "resume":
        with pytest.raises(ValueError) as e:
            checkpoint_io.load(_Untouchable(), ckpt)
        lines = [str(e.value)]
    else:
        rc, lines = (_export(tmp_path / "run", out, capsys) if reader == "export"
                     else _convert(ckpt / "model", out, capsys))
        assert rc == 2, lines
    assert len(lines) == 1 and "\n" not in lines[0] and needle in lines[0], lines
    assert not marker.exists(), "the payload ran"
    assert _hashes(tmp_path) == before, "the reader wrote something"


def _save_next(trainer, run_dir: Path):
    from megaflow.rundir import checkpoint_io
    dconfig = json.loads((run_dir / "tiny-pipeline" / "transformer" / "config.json").read_text())
    checkpoint_io.save(trainer, run_dir, 2, family="sd3", diffusers_config=dconfig, prompts_consumed=8,
               metrics_rows=[{"iteration": 1}, {"iteration": 2}], keep=2)


def _torch_writer_on_a_full_disk(state, directory):
    """What megatron's save does on a full disk: part of a .distcp written, then torch's CheckpointException
    around the zip writer's error (no OS error in it), and no byte left free."""
    from torch.distributed.checkpoint.api import CheckpointException
    (Path(directory) / "__0_0.distcp").write_bytes(bytes(4096))
    raise CheckpointException("write", {0: RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")})


class _FullDiskFile:
    """A file whose writes fail with ENOSPC after the first 100 bytes (what a full disk does to state.json)."""

    def __init__(self, path, mode):
        self._fh = open(path, mode)

    def write(self, data):
        self._fh.write(data[:100])
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self._fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()


@pytest.mark.parametrize("where", ["torch's writer", "state.json"])
def test_a_full_disk_during_a_save_is_one_line_and_the_previous_checkpoint_stays(saved, tmp_path, monkeypatch,
                                                                                   where):
    from collections import namedtuple
    from types import SimpleNamespace

    from megaflow.rundir import checkpoint_io
    from megaflow.trainer import checkpoint
    from megaflow.trainer.disk_full import NoSpace

    run_dir, trainer, weights = saved
    run_dir = Path(shutil.copytree(run_dir, tmp_path / "run", symlinks=True))
    distcp_bytes = sum(f.stat().st_size for f in (checkpoint_of(run_dir) / "model").glob("*.distcp"))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("shutil.disk_usage", lambda path: usage(10**9, 10**9, 0))
    if where == "state.json":
        monkeypatch.setattr(checkpoint_io, "open", _FullDiskFile, raising=False)  # checkpoint_io.py's own writes only
    else:
        monkeypatch.setattr(checkpoint, "dist_checkpointing", SimpleNamespace(save=_torch_writer_on_a_full_disk))
    with pytest.raises(NoSpace) as e:
        _save_next(trainer, run_dir)
    message = str(e.value)
    assert "\n" not in message and str(run_dir / "checkpoints" / "iter_000002") in message
    assert str(checkpoint_of(run_dir)) in message and "is still the latest checkpoint" in message
    if where == "torch's writer":  # what the checkpoint needs: its tensors, within 15% of the real .distcp
        assert 0.85 * distcp_bytes <= e.value.needed <= distcp_bytes
    assert f"needs about {e.value.needed} bytes" in message
    left = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")
                  if p.name.startswith(".") or p.name.endswith(".tmp") or "staging" in p.name or ".tmp-" in p.name)
    assert left == ["checkpoints/iter_000001/model/.metadata"]  # torch's own, of the kept checkpoint
    monkeypatch.undo()
    with torch.no_grad():
        for p in trainer.chunks[0].parameters():
            p.add_(1.0)
    assert checkpoint_io.load(trainer, checkpoint_of(run_dir))["iteration"] == 1  # the previous checkpoint loads
    from megaflow.bridge.convert import engine_named_params
    assert all(torch.equal(v, weights[k]) for k, v in engine_named_params(trainer))


def test_the_cli_says_a_full_disk_in_one_line(tmp_path, monkeypatch, capsys):
    from megaflow.commands import export
    from megaflow.trainer.disk_full import NoSpace

    def full(*args, **kwargs):
        raise NoSpace(tmp_path / "out", 5000, 12, tmp_path)

    monkeypatch.setattr(export, "export_run", full)
    assert cli.main(["export", "--run", str(tmp_path), "--out", str(tmp_path / "out")]) == 1
    assert _lines(capsys.readouterr().err, "megaflow:") == [
        f"megaflow: error: {tmp_path / 'out'}: not written, the disk is full: it needs about 5000 bytes (0.0 MiB), "
        f"12 are free on {tmp_path}"]


def _rotating(run_dir: Path, monkeypatch, *, new_iteration: int):
    """What a running run does while an export reads its latest checkpoint (megaflow.rundir.checkpoint_io.save):
    at the export's first manifest check, a newer checkpoint appears (renamed in whole from a staging dir) and the
    one being read is rotated out (megaflow.rundir.checkpoints.remove_checkpoint)."""
    from megaflow.commands import export
    from megaflow.rundir.checkpoints import checkpoint_dir, remove_checkpoint

    real, calls = export.verify_manifest, []

    def verify(ckpt, **kwargs):
        if not calls:
            stage = run_dir / "checkpoints" / ".staging-new"
            shutil.copytree(ckpt, stage)
            os.rename(stage, checkpoint_dir(run_dir, new_iteration))
            remove_checkpoint(Path(ckpt))
        calls.append(ckpt)
        return real(ckpt, **kwargs)

    monkeypatch.setattr(export, "verify_manifest", verify)
    return calls


@pytest.mark.parametrize("named", [False, True])
def test_an_export_during_a_rotation_reads_a_kept_checkpoint_or_says_so(saved, tmp_path, monkeypatch, capsys, named):
    """The latest checkpoint is rotated out while the export reads it: the export retries on the new latest (its
    weights: the trainer's, tolerance 0) or, for a named --iteration, says in one line that it was removed and which
    are kept; nothing half-written either way."""
    from safetensors.torch import load_file

    run_dir, _, weights = saved
    run_dir = Path(shutil.copytree(run_dir, tmp_path / "run", symlinks=True))
    calls = _rotating(run_dir, monkeypatch, new_iteration=2)
    argv = ["export", "--run", str(run_dir), "--out", str(tmp_path / "out"), "--no-ema", "--json"]
    rc = cli.main(argv + (["--iteration", "1"] if named else []))
    captured = capsys.readouterr()
    if named:
        assert rc == 2 and not (tmp_path / "out").exists()
        assert _lines(captured.err, "megaflow:") == [
            f"megaflow: error: {checkpoint_of(run_dir)}: removed while it was read (the run rotated it out, "
            "train.keep_checkpoints); it keeps iterations [2]: pass one of them as --iteration"]
        return
    assert rc == 0 and json.loads(captured.out)["iteration"] == 2 and len(calls) == 2
    exported = load_file(tmp_path / "out" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(exported[k], weights[k]) for k in weights)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]


@pytest.mark.parametrize("reader", ["export", "convert"])
@pytest.mark.parametrize("when", ["before writing", "while writing"])
def test_an_export_to_a_full_disk_is_one_line_and_leaves_nothing(saved, tmp_path, monkeypatch, capsys, when, reader):
    """Too little space for what the export writes (the pipeline and the weights): refused before writing; or the
    disk fills while safetensors writes (its error is no OSError, as on a real full disk): one NoSpace line naming
    the output and the bytes needed (at least the weights'), no temp dir or output left; ``megaflow export`` and
    ``to-diffusers`` alike."""
    from collections import namedtuple

    import safetensors.torch

    run_dir, _, weights = saved
    usage = namedtuple("usage", "total used free")
    frees = iter([10**12] if when == "while writing" else [])
    monkeypatch.setattr("shutil.disk_usage", lambda path: usage(10**12, 0, next(frees, 12)))

    def fills_the_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(bytes(100))
        raise safetensors.SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                          'message: "No space left on device" })')

    monkeypatch.setattr(safetensors.torch, "save_file", fills_the_disk)
    out = tmp_path / "out"
    if reader == "export":
        rc = cli.main(["export", "--run", str(run_dir), "--out", str(out), "--no-ema"])
        [line] = _lines(capsys.readouterr().err, "megaflow: error: ")
        assert rc == 1
    else:
        rc, [line] = _convert(checkpoint_of(run_dir) / "model", out, capsys)
        assert rc == 2
    prefix = "megaflow: error: " if reader == "export" else "error: "
    assert line.startswith(f"{prefix}{out}: not written, the disk is full: it needs about "), line
    needed = int(line.split("needs about ")[1].split()[0])
    assert needed >= sum(v.numel() * v.element_size() for v in weights.values())
    assert line.endswith(f"12 are free on {tmp_path}; " + ("nothing written" if when == "before writing"
                                                           else "nothing of it is left"))
    assert list(tmp_path.iterdir()) == []
