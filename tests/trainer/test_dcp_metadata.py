"""The pickles of a distributed checkpoint are checked before torch unpickles them (megaflow.trainer.dcp_metadata):
torch's own metadata and items pass; a crafted ``.metadata`` is refused in one line naming the global it asks for,
a crafted non-tensor item in a ``.distcp`` file in one line naming the item, and nothing of either runs -- also
through the load path ``megaflow export`` and ``to-diffusers`` use, and even when the manifest is intact.
Needs: CPU, 1 process (< 5 s)."""
from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megaflow.trainer.checkpoint import load_full_state_dict
from megaflow.trainer.dcp_metadata import METADATA, check_dcp_metadata
from megaflow.trainer.manifest import write_manifest


class _RunsCode:
    """Unpickling this runs ``os.system`` (what a crafted checkpoint would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_torch_written_metadata_passes(tmp_path):
    state = {"w": torch.randn(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16), "step": 7,
             "extra": {"lr": 0.1, "names": ["a", "b"]}}
    dcp.save(state, checkpoint_id=str(tmp_path))
    assert (tmp_path / METADATA).is_file()
    check_dcp_metadata(tmp_path)


def _crafted(directory, marker):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / METADATA).write_bytes(pickle.dumps({"state_dict_metadata": _RunsCode(marker)}))
    (directory / "megaflow_model.json").write_text('{"format": 1, "family": "sd3"}')
    write_manifest(directory)  # intact: the manifest guards integrity, not what the pickle asks for
    return directory


def test_a_crafted_metadata_is_refused_naming_the_global_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    ckpt = _crafted(tmp_path / "model", marker)
    with pytest.raises(ValueError) as e:
        check_dcp_metadata(ckpt)
    message = str(e.value)
    assert "\n" not in message and str(ckpt / METADATA) in message and "system" in message
    with pytest.raises(ValueError, match="system"):
        load_full_state_dict(ckpt)
    assert not marker.exists()


def test_a_crafted_item_inside_a_distcp_file_is_refused_and_runs_nothing(tmp_path):
    """The metadata is torch's own; one non-tensor item (a torch.save blob torch's planner would load with
    weights_only=False) asks for os.system."""
    marker = tmp_path / "ran"
    dcp.save({"w": torch.ones(2), "extra": _RunsCode(marker)}, checkpoint_id=str(tmp_path / "ckpt"))
    with pytest.raises(ValueError) as e:
        check_dcp_metadata(tmp_path / "ckpt")
    message = str(e.value)
    assert "\n" not in message and "'extra'" in message and "weights_only" in message and ".distcp" in message
    assert not marker.exists()


def test_garbage_metadata_is_one_line(tmp_path):
    (tmp_path / METADATA).write_bytes(b"\x80\x05not a pickle at all")
    with pytest.raises(ValueError, match="unreadable checkpoint metadata") as e:
        check_dcp_metadata(tmp_path)
    assert "\n" not in str(e.value)
