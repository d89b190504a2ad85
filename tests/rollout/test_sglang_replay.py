"""The SGLang engine's replay store (megaflow.rollout.sglang.replay), without an engine: a staging slot's
tensors are kept as views (no copy), anything else as the store's own host copy, and ``apply`` re-sends it all."""
import torch

import megaflow  # noqa: F401  (import guards before sglang/megatron)
from megaflow.bridge.buckets import StagingSlots, pack
from megaflow.rollout.sglang import replay


def test_slot_tensors_are_kept_as_views_others_copied():
    store = replay.ReplayStore()
    slots = StagingSlots()
    bucket = pack([("a", torch.ones(4)), ("b", torch.zeros(2))], staging=slots)
    store.keep(dict(bucket.unpack()), alias=True)
    assert store.tensors["a"].data_ptr() == bucket.unpack()[0][1].data_ptr()  # no copy
    pack([("a", torch.full((4,), 3.0)), ("b", torch.zeros(2))], staging=slots)  # the next sync, in place
    assert torch.equal(store.tensors["a"], torch.full((4,), 3.0))
    src = torch.full((4,), 5.0)
    store.keep({"a": src}, alias=False)  # a copy, never written into the slot
    assert store.tensors["a"].data_ptr() != src.data_ptr() and torch.equal(bucket.unpack()[0][1], torch.full((4,), 3.0))
    kept = store.tensors["a"]
    store.keep({"a": torch.full((4,), 6.0)}, alias=False)  # its own copy: reused
    assert store.tensors["a"] is kept and torch.equal(kept, torch.full((4,), 6.0))


def test_apply_replays_disk_then_tensors_then_lora():
    calls = []

    class Server:
        def update_from_disk(self, path):
            calls.append(("disk", path))
            return True, ""

        def update_from_bucket(self, flat, metadata):
            calls.append(("bucket", sorted(m.name for m in metadata)))
            return True, ""

        def update_lora_from_tensors(self, named, *, alpha, rank):
            calls.append(("lora", alpha, rank))
            return True, ""
    store = replay.ReplayStore()
    assert store.apply(Server()) == [] and calls == []
    store.keep({"a": torch.ones(2)}, alias=False)
    store.reset_to_disk("/pipe")
    store.keep({"b": torch.ones(2)}, alias=False)
    store.keep_lora([("x.lora_A", torch.ones(2, 2))], 2.0, 4)
    assert all(ok for ok, _ in store.apply(Server()))
    assert calls == [("disk", "/pipe"), ("bucket", ["b"]), ("lora", 2.0, 4)]
