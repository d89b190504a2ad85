"""Checkpoint manifests (megaflow.trainer.manifest): written last, checked before a checkpoint is read; a missing,
truncated, modified or unlisted file, or no manifest (unless trusted), is refused with one line naming the file.

Needs: CPU, 1 process (< 1 s)."""
from __future__ import annotations

import json

import pytest

from megaflow.trainer.manifest import MANIFEST, verify_manifest, write_manifest


def _checkpoint(root, checksum="xxh3"):
    """A run checkpoint's shape: iter dir with state.json and a model/ dist checkpoint with its own manifest."""
    model = root / "model"
    model.mkdir(parents=True)
    (model / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)
    (model / "__1_0.distcp").write_bytes(b"\x01" * 1000)
    (model / ".metadata").write_bytes(b"pickled metadata")
    (model / "common.pt").write_bytes(b"common")
    (model / "megaflow_model.json").write_text("{}")
    write_manifest(model, checksum)
    (root / "state.json").write_text('{"iteration": 1}')
    write_manifest(root, checksum)
    return root


@pytest.mark.parametrize("checksum", ["xxh3", "sha256"])
def test_write_then_verify_passes(tmp_path, checksum):
    ckpt = _checkpoint(tmp_path / "iter_000001", checksum)
    verify_manifest(ckpt)
    verify_manifest(ckpt / "model")
    top = json.loads((ckpt / MANIFEST).read_text())
    assert top["checksum"] == checksum and sorted(top["files"]) == ["model/MANIFEST.json", "state.json"]
    model = json.loads((ckpt / "model" / MANIFEST).read_text())["files"]
    assert sorted(model) == [".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt", "megaflow_model.json"]
    assert not list(ckpt.rglob(f".{MANIFEST}.tmp"))


def _refusal(ckpt, **kw) -> str:
    with pytest.raises(ValueError) as e:
        verify_manifest(ckpt, **kw)
    message = str(e.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("checksum", ["xxh3", "sha256"])
def test_a_flipped_byte_in_a_distcp_file_is_refused_naming_it(tmp_path, checksum):
    ckpt = _checkpoint(tmp_path / "iter_000001", checksum)
    shard = ckpt / "model" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[5000] ^= 0x10
    shard.write_bytes(bytes(data))
    message = _refusal(ckpt)
    assert str(shard) in message and "differ" in message
    assert str(shard) in _refusal(ckpt / "model")
    assert str(shard) in _refusal(ckpt, trust=True)  # a manifest that is there is always checked


def test_truncation_is_refused(tmp_path):
    ckpt = _checkpoint(tmp_path / "iter_000001")
    shard = ckpt / "model" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:500])
    message = _refusal(ckpt)
    assert str(shard) in message and "500 bytes" in message


def test_a_missing_manifest_is_refused_unless_trusted(tmp_path):
    ckpt = _checkpoint(tmp_path / "iter_000001")
    (ckpt / MANIFEST).unlink()
    message = _refusal(ckpt)
    assert str(ckpt / MANIFEST) in message and "--trust-checkpoint" in message
    verify_manifest(ckpt, trust=True)
    (ckpt / "model" / MANIFEST).unlink()
    assert str(ckpt / "model" / MANIFEST) in _refusal(ckpt / "model")
    verify_manifest(ckpt / "model", trust=True)


def test_a_missing_a_modified_state_and_an_extra_file_are_refused(tmp_path):
    ckpt = _checkpoint(tmp_path / "iter_000001")
    (ckpt / "model" / "common.pt").unlink()
    assert str(ckpt / "model" / "common.pt") in _refusal(ckpt)
    ckpt = _checkpoint(tmp_path / "iter_000002")
    (ckpt / "state.json").write_text('{"iteration": 2}')  # same size, other contents
    assert str(ckpt / "state.json") in _refusal(ckpt)
    ckpt = _checkpoint(tmp_path / "iter_000003")
    (ckpt / "model" / "evil.pt").write_bytes(b"x")
    message = _refusal(ckpt)
    assert str(ckpt / "model" / "evil.pt") in message and "not listed" in message
    ckpt = _checkpoint(tmp_path / "iter_000004")
    (ckpt / MANIFEST).write_text("not json")
    assert "unreadable" in _refusal(ckpt)
