"""The weight payload megaflow sends SGLang (megaflow.rollout.sglang.weights), checked without an engine:
the request SGLang's worker receives is deserialized by SGLang's own code (its SafeUnpickler and the
flattened-bucket reader its WeightsUpdater runs) and must give back every tensor bit for bit, by name,
dtype and shape. CPU only: the CUDA branch (IPC handle, GPU UUID) needs a GPU and is not run here."""
import pytest
import torch

import megaflow  # noqa: F401  (import guards before sglang/megatron)
from megaflow.bridge.buckets import pack
from megaflow.rollout.sglang import weights


def _named():
    g = torch.Generator().manual_seed(0)
    return [("transformer_blocks.0.attn.to_q.weight", torch.randn(8, 8, generator=g)),
            ("pos_embed.pos_embed", torch.randn(1, 4, 8, generator=g)),  # fp32 beside bf16 tensors
            ("norm_out.linear.bias", torch.randn(5, generator=g).to(torch.bfloat16)),
            ("proj_out.weight", torch.randn(3, 8, generator=g).to(torch.bfloat16))]


def _worker_side(req):
    """What SGLang's worker does with the request: pick its payload, deserialize, cut the bucket."""
    from sglang.multimodal_gen.runtime.post_training.weights_updater import WeightsUpdater
    from sglang.srt.utils import MultiprocessingSerializer
    assert req.load_format == "flattened_bucket" and req.target_modules == ["transformer"]
    assert len(req.serialized_named_tensors) == 1
    payload = MultiprocessingSerializer.deserialize(req.serialized_named_tensors[0])
    assert set(payload) == {"transformer"} and set(payload["transformer"]) == {"flattened_tensor", "metadata"}
    updater = WeightsUpdater.__new__(WeightsUpdater)  # the reader needs no pipeline
    return list(updater._materialize_weights_iter(payload["transformer"], "flattened_bucket"))


@pytest.mark.parametrize("source", ["bridge_bucket", "flatten"])
def test_cpu_payload_round_trips_bit_exact(source):
    named = _named()
    if source == "bridge_bucket":
        bucket = pack(named, shared=True)
        flat, meta = bucket.flat, bucket.metadata
    else:
        flat, meta = weights.flatten(named)
    req = weights.update_request(flat, meta)
    assert req.payload_gpu_uuids is None and flat.is_shared()
    got = _worker_side(req)
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, want), (_, t) in zip(named, got):
        assert t.dtype == want.dtype and t.shape == want.shape
        assert torch.equal(t.view(torch.uint8), want.contiguous().view(torch.uint8))


def test_cpu_payload_shares_the_bucket_memory():
    """A bucket already in shared memory travels as a handle to it: the worker's tensors alias its bytes."""
    bucket = pack(_named(), shared=True)
    ptr = bucket.flat.untyped_storage().data_ptr()
    req = weights.update_request(bucket.flat, bucket.metadata)
    assert bucket.flat.untyped_storage().data_ptr() == ptr  # not moved (no copy on send)
    got = _worker_side(req)
    bucket.flat[bucket.metadata[0].start_idx] ^= 0xFF  # a change here is seen through the worker's views
    assert not torch.equal(got[0][1], _named()[0][1])


def test_rejects_a_non_flat_tensor():
    with pytest.raises(ValueError, match="1-D uint8"):
        weights.update_request(torch.zeros(4), [])


def test_slot_payload_names_its_key_and_the_plugin_keeps_its_mapping():
    """A bucket from a staging slot carries the slot's key (SGLang's reader ignores the extra entry); the
    plugin's hook around that reader keeps the worker's tensor under the key, replacing what it kept there. A
    later payload of the same memory (``kept``) names the key alone and reads the tensor kept there; a key the
    worker does not hold is refused."""
    from megaflow.bridge.buckets import StagingSlots
    from megaflow.rollout.sglang import plugin
    from sglang.srt.utils import MultiprocessingSerializer
    slots = StagingSlots()
    bucket = pack(_named(), staging=slots)
    assert bucket.slot and bucket.flat.is_shared()

    def received(**kw):
        req = weights.update_request(bucket.flat, bucket.metadata, keep=bucket.slot, **kw)
        return MultiprocessingSerializer.deserialize(req.serialized_named_tensors[0])["transformer"]
    module_payload = received()
    assert module_payload[weights.KEEP_KEY] == bucket.slot
    try:
        got = plugin.keep_mapping(_reader, None, module_payload, "flattened_bucket")
        assert [n for n, _ in got] == [n for n, _ in _named()]
        assert plugin._kept[bucket.slot] is module_payload["flattened_tensor"]
        named_only = received(kept=True)
        assert "flattened_tensor" not in named_only
        again = plugin.keep_mapping(_reader, None, named_only, "flattened_bucket")
        assert named_only["flattened_tensor"] is module_payload["flattened_tensor"]
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for (_, a), (_, b) in zip(got, again))
        plugin.keep_mapping(_reader, None, {"flattened_tensor": torch.zeros(1), "metadata": []}, "flattened_bucket")
        assert list(plugin._kept) == [bucket.slot]  # no key: nothing kept
        plugin._kept.clear()
        with pytest.raises(ValueError, match="not mapped in this worker"):
            plugin.keep_mapping(_reader, None, received(kept=True), "flattened_bucket")
    finally:
        plugin._kept.clear()
    assert weights.KEEP_KEY not in MultiprocessingSerializer.deserialize(
        weights.update_request(bucket.flat, bucket.metadata).serialized_named_tensors[0])["transformer"]
    with pytest.raises(ValueError, match="kept=True names a staging slot"):
        weights.update_request(bucket.flat, bucket.metadata, kept=True)


def _reader(updater, module_payload, load_format):
    """SGLang's flattened-bucket reader (the hooked ``_materialize_weights_iter``), as a list."""
    from sglang.multimodal_gen.runtime.post_training.weights_updater import WeightsUpdater
    return list(WeightsUpdater._materialize_weights_iter(WeightsUpdater.__new__(WeightsUpdater), module_payload,
                                                          load_format))


def test_worker_tensor_hash_matches_sglangs_and_the_bridges(monkeypatch):
    """The plugin's replacement for SGLang's checker hash: with sha256 SGLang's own digests (hashed in place),
    by default (and with xxh3) the bridge's xxh3 digests."""
    from sglang.multimodal_gen.runtime.post_training.tensor_update_checker import compute_tensor_sha256

    from megaflow.checksum import tensor_digest
    from megaflow.rollout.sglang import weight_checks
    tensors = [t for _, t in _named()] + [torch.randn(6, 4)[:, 1], torch.arange(5)]
    monkeypatch.delenv(weight_checks.CHECKSUM_VAR, raising=False)
    assert all(weight_checks.tensor_digest(t) == tensor_digest(t, "xxh3") for t in tensors)
    monkeypatch.setenv(weight_checks.CHECKSUM_VAR, "sha256")
    assert all(weight_checks.tensor_digest(t) == compute_tensor_sha256(t) for t in tensors)
    monkeypatch.setenv(weight_checks.CHECKSUM_VAR, "xxh3")
    assert all(weight_checks.tensor_digest(t) == tensor_digest(t, "xxh3") for t in tensors)


def test_digests_ride_in_the_payload_and_the_worker_pops_them():
    """``digests`` travel in the module payload under ``DIGESTS_KEY``; the worker's hook takes them out before
    SGLang reads the payload (which then looks like any other)."""
    from sglang.srt.utils import MultiprocessingSerializer

    from megaflow.checksum import tensor_digest
    from megaflow.rollout.sglang import weight_checks
    named = _named()
    bucket = pack(named, shared=True)
    digests = {n: tensor_digest(t, "xxh3") for n, t in named}
    req = weights.update_request(bucket.flat, bucket.metadata, digests=digests)
    payload = MultiprocessingSerializer.deserialize(req.serialized_named_tensors[0])
    assert weight_checks._take_digests(payload) == ("transformer", digests)
    assert set(payload["transformer"]) == {"flattened_tensor", "metadata"}
    assert weight_checks._take_digests(payload) is None


def test_worker_hashes_each_parameter_as_it_is_copied(monkeypatch):
    """``hash_as_copied`` around SGLang's own ``load_weights_into_model``, during a checked update: a plain host
    parameter is copied here a chunk at a time and hashed as written (``checksum.copy_hashed``); one with its own
    ``weight_loader`` is left to SGLang and hashed after its copy (the digests are those of the new values); without
    a checked update SGLang copies everything and nothing is hashed."""
    import inspect

    from sglang.multimodal_gen.runtime.post_training import weights_updater

    import megaflow.checksum as checksum
    from megaflow.checksum import tensor_digest
    from megaflow.rollout.sglang import weight_checks
    # SGLang's own function, not the plugin's hook around it (applied in this process once an engine started here)
    load_weights_into_model = inspect.unwrap(weights_updater.load_weights_into_model)
    monkeypatch.delenv(weight_checks.CHECKSUM_VAR, raising=False)
    named = [(n, t.float()) for n, t in _named()] + [("big", torch.randn(600, 700))]  # 1.7 MB: chunked
    params = {n: torch.nn.Parameter(torch.zeros_like(t), requires_grad=False) for n, t in named}
    loaded = []
    params[named[1][0]].weight_loader = lambda p, w: loaded.append(w) or p.data.copy_(w)
    expected = {n: tensor_digest(t, "xxh3") for n, t in named if n != named[3][0]}  # the 4th: loaded, not checked
    copied_here, hashed_after = [], []
    real_copy, real_like = checksum.copy_hashed, checksum.digest_like
    monkeypatch.setattr(checksum, "copy_hashed",
                        lambda d, s, a: copied_here.append(tuple(d.shape)) or real_copy(d, s, a))
    monkeypatch.setattr(checksum, "digest_like", lambda t, e, a: hashed_after.append(t.clone()) or real_like(t, e, a))
    check = weight_checks._Check("transformer", expected)
    monkeypatch.setattr(weight_checks, "_current", check)
    weight_checks.hash_as_copied(load_weights_into_model, iter(named), params)
    assert check.actual == expected
    assert all(torch.equal(params[n], t) for n, t in named)
    assert copied_here == [tuple(t.shape) for n, t in named if n in expected and n != named[1][0]]
    assert len(loaded) == 1 and len(hashed_after) == 1 and torch.equal(hashed_after[0], named[1][1])  # after the copy
    monkeypatch.setattr(weight_checks, "_current", None)
    for p in params.values():
        p.data.zero_()
    weight_checks.hash_as_copied(load_weights_into_model, iter(named), params)
    assert all(torch.equal(params[n], t) for n, t in named)
    assert len(copied_here) == 3 and len(hashed_after) == 1  # no checked update: SGLang copied, nothing hashed
