"""Weight-update bridge: buckets, shared-memory / disk / distributed paths, verification.
Needs: CPU, 1 process (distributed: 2 gloo processes). Targets are real tiny diffusers SD3 DiTs."""
import pytest
import torch

from megaflow.bridge import Bucket, SyncError, iter_buckets, pack, tensor_digest
from megaflow.bridge.shared_memory import SharedMemoryBridge
from megaflow.bridge.disk import DiskBridge
from megaflow.bridge.target import ModuleTarget


def tiny_dit(seed):
    from diffusers import SD3Transformer2DModel
    torch.manual_seed(seed)
    return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16,
                                 num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                                 pooled_projection_dim=16, out_channels=4, pos_embed_max_size=8)


def state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def test_pack_roundtrip_mixed_dtypes():
    named = [("a", torch.randn(3, 4)), ("b", torch.arange(5, dtype=torch.int64)),
             ("c", torch.randn(2, 2).to(torch.bfloat16))]
    b = pack(named)
    assert b.num_bytes == 48 + 40 + 8 + 8  # every tensor starts 16-byte aligned: 8 bytes of padding before c
    assert [m.start_idx % 16 for m in b.metadata] == [0, 0, 0]
    for (n0, t0), (n1, t1) in zip(named, b.unpack()):
        assert n0 == n1 and t0.dtype == t1.dtype and torch.equal(t0, t1)


def test_iter_buckets_bounds_size_and_rejects_duplicates():
    named = [(f"t{i}", torch.zeros(256)) for i in range(10)]  # 1 KiB each
    buckets = list(iter_buckets(iter(named), bucket_bytes=3000))
    assert [len(b.metadata) for b in buckets] == [2, 2, 2, 2, 2]
    assert len(list(iter_buckets(iter([("big", torch.zeros(4096))]), 100))) == 1
    with pytest.raises(ValueError, match="'t0' appears twice"):
        list(iter_buckets(iter([("t0", torch.zeros(1)), ("t0", torch.zeros(1))]), 100))


@pytest.mark.parametrize("checksum", ["xxh3", "sha256"])
def test_digest_sensitive_to_dtype_shape_value(checksum):
    t = torch.arange(6, dtype=torch.float32)
    base = tensor_digest(t, checksum)
    assert len(base) == {"xxh3": 32, "sha256": 64}[checksum]
    assert tensor_digest(t.clone(), checksum) == base
    assert tensor_digest(t.reshape(2, 3), checksum) != base
    assert tensor_digest(t.to(torch.float64), checksum) != base
    t2 = t.clone(); t2[3] += 1e-6
    assert tensor_digest(t2, checksum) != base
    with pytest.raises(ValueError, match="unknown checksum"):
        tensor_digest(t, "md5")


@pytest.mark.parametrize("checksum", ["xxh3", "sha256"])
def test_bucket_digests_equal_per_tensor_digests_and_shared_memory(checksum):
    named = [("a", torch.randn(3, 5)), ("b", torch.randn(7).to(torch.bfloat16)), ("c", torch.randn(2, 3).t()),
             ("d", torch.arange(3, dtype=torch.int64)), ("e", torch.zeros(0))]
    bucket = pack(named, shared=True)
    assert bucket.flat.is_shared() and not pack(named).flat.is_shared()
    assert bucket.digests(checksum) == {n: tensor_digest(t, checksum) for n, t in named}
    for (n0, t0), (n1, t1) in zip(named, bucket.unpack()):  # a non-contiguous source packs by value
        assert n0 == n1 and t0.dtype == t1.dtype and torch.equal(t0, t1)


@pytest.mark.parametrize("bucket_bytes", [1 << 10, 64 << 20])
def test_shared_memory_push_updates_and_verifies(bucket_bytes):
    src, dst1, dst2 = tiny_dit(0), tiny_dit(1), tiny_dit(2)
    bridge = SharedMemoryBridge([ModuleTarget(dst1), ModuleTarget(dst2)], bucket_bytes=bucket_bytes)
    report = bridge.push(src.state_dict().items())
    assert report.verified and report.num_tensors == len(src.state_dict())
    assert report.num_buckets >= (2 if bucket_bytes < 1 << 20 else 1)
    for dst in (dst1, dst2):
        for k, v in src.state_dict().items():
            assert torch.equal(v, dst.state_dict()[k]), k


def test_module_target_checksum_follows_its_weights():
    """``ModuleTarget.checksum`` (megaflow.checksum.weights_checksum): equal for equal state_dicts, different after a
    one-element change, and the source's after a push."""
    src, dst = tiny_dit(0), tiny_dit(1)
    source, target = ModuleTarget(src), ModuleTarget(dst)
    assert source.checksum() != target.checksum() and source.checksum() == ModuleTarget(tiny_dit(0)).checksum()
    SharedMemoryBridge([target], bucket_bytes=4 << 10).push(src.state_dict().items())
    assert target.checksum() == source.checksum()
    with torch.no_grad():
        next(dst.parameters()).view(-1)[0] += 1.0
    assert target.checksum() != source.checksum()


class _Rendezvous(ModuleTarget):
    """A target whose load waits for the other target's load to start: passes only if they run at once."""

    def __init__(self, module, barrier):
        super().__init__(module)
        self.barrier = barrier

    def load_bucket(self, bucket, **kw):
        self.barrier.wait()
        return super().load_bucket(bucket, **kw)


def test_shared_memory_push_loads_engines_in_parallel():
    import threading
    src, barrier = tiny_dit(0), threading.Barrier(2, timeout=10)
    targets = [_Rendezvous(tiny_dit(1), barrier), _Rendezvous(tiny_dit(2), barrier)]
    report = SharedMemoryBridge(targets, bucket_bytes=16 << 10).push(src.state_dict().items())
    assert report.verified and report.num_buckets > 1
    for t in targets:
        assert all(torch.equal(v, t.module.state_dict()[k]) for k, v in src.state_dict().items())


def test_shared_memory_reuses_its_staging_slots_across_syncs():
    """Each bucket position of a sync has its own shared-memory slot (touched once), reused by the bucket at
    that position in every later sync with the same layout; each sync still lands bit for bit."""
    seen = []

    class Recording(ModuleTarget):
        def load_bucket(self, bucket, **kw):
            seen.append((bucket.flat.untyped_storage().data_ptr(), bucket.flat.is_shared(), bucket.slot))
            return super().load_bucket(bucket, **kw)
    dst = tiny_dit(2)
    bridge = SharedMemoryBridge([Recording(dst)], bucket_bytes=16 << 10)
    per_sync = []
    for seed in (0, 1):
        src = tiny_dit(seed)
        assert bridge.push(src.state_dict().items()).verified
        assert all(torch.equal(v, dst.state_dict()[k]) for k, v in src.state_dict().items())
        per_sync.append(list(seen))
        seen.clear()
    assert per_sync[0] == per_sync[1], per_sync  # the second sync allocates nothing
    assert len(per_sync[0]) > 1 and len({ptr for ptr, _, _ in per_sync[0]}) == len(per_sync[0])
    assert all(shared and slot for _, shared, slot in per_sync[0])
    assert len({slot for _, _, slot in per_sync[0]}) == len(per_sync[0])


def test_staging_slot_gets_new_memory_when_its_layout_changes():
    """A slot is overwritten in place only by the same layout; another layout gets new memory under the same
    key, so views of the old bucket (an engine's replay store) keep the old bytes."""
    from megaflow.bridge.buckets import StagingSlots
    slots = StagingSlots()
    a = pack([("a", torch.ones(4))], staging=slots)
    a_view = a.unpack()[0][1]
    a2 = pack([("a", torch.full((4,), 2.0))], staging=slots)
    assert a2.flat.data_ptr() == a.flat.data_ptr() and a2.slot == a.slot and torch.equal(a_view, torch.full((4,), 2.0))
    b = pack([("b", torch.zeros(8))], staging=slots)
    assert b.flat.data_ptr() != a.flat.data_ptr() and b.slot == a.slot
    assert torch.equal(a_view, torch.full((4,), 2.0))
    assert pack([("c", torch.zeros(2))], staging=slots, index=1).slot != a.slot
    assert pack([("c", torch.zeros(2))]).slot is None


def _bumped(bucket, name):
    """``bucket`` as a lossy transfer would deliver it: ``name``'s values + 1 (the bridge packed and hashed the
    original); the bucket itself when it does not hold ``name``."""
    meta = next((m for m in bucket.metadata if m.name == name), None)
    if meta is None:
        return bucket
    flat = bucket.flat.clone()
    flat[meta.start_idx:meta.end_idx].view(meta.dtype).add_(1.0)
    return Bucket(flat=flat, metadata=bucket.metadata)


def test_shared_memory_stops_at_the_first_bucket_that_does_not_verify():
    """With verify, every engine checks each bucket against the bridge's digests as it loads it; the first
    bucket that does not verify (here the first one) fails the sync before the next is handed over."""
    src, dst = tiny_dit(0), tiny_dit(1)
    loads = []

    class CorruptFirst(ModuleTarget):
        def load_bucket(self, bucket, **kw):
            loads.append(bucket)
            return super().load_bucket(_bumped(bucket, bucket.metadata[0].name) if len(loads) == 1 else bucket, **kw)
    with pytest.raises(SyncError, match="failed at bucket 1: did not verify"):
        SharedMemoryBridge([CorruptFirst(dst)], bucket_bytes=4 << 10).push(src.state_dict().items())
    assert len(loads) == 1


def test_shared_memory_rejects_unknown_name_without_partial_write():
    dst = tiny_dit(1)
    before = state(dst)
    named = [("pos_embed.proj.weight", torch.zeros_like(before["pos_embed.proj.weight"])),
             ("no.such.weight", torch.zeros(2))]
    with pytest.raises(SyncError, match="unknown tensor 'no.such.weight'"):
        SharedMemoryBridge([ModuleTarget(dst)], bucket_bytes=1 << 20).push(named)
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())


class _Corrupting(ModuleTarget):
    """A target that receives ``proj_out.bias`` changed in flight (what a lossy transfer would do)."""

    def load_bucket(self, bucket, **kw):
        return super().load_bucket(_bumped(bucket, "proj_out.bias"), **kw)


def test_verification_catches_lossy_transfer():
    src, dst = tiny_dit(0), tiny_dit(1)
    with pytest.raises(SyncError, match="proj_out.bias"):
        SharedMemoryBridge([_Corrupting(dst)]).push(src.state_dict().items())



class _DamagedInFlight(ModuleTarget):
    """A target that receives a damaged copy of each bucket (packed and hashed intact by the bridge): one byte
    flipped mid-bucket (``flip``) or everything after the bucket's first half lost (``partial``, zeros)."""

    def __init__(self, module, damage: str):
        super().__init__(module)
        self.damage = damage

    def load_bucket(self, bucket, **kw):
        flat = bucket.flat.clone()
        if self.damage == "flip":
            flat[flat.numel() // 2] ^= 0x01
        else:
            flat[flat.numel() // 2:] = 0
        return super().load_bucket(Bucket(flat=flat, metadata=bucket.metadata), **kw)


@pytest.mark.parametrize("damage", ["flip", "partial"])
@pytest.mark.parametrize("checksum", ["xxh3", "sha256"])
def test_a_bucket_damaged_between_pack_and_load_is_refused(checksum, damage):
    src = tiny_dit(0)
    state = list(src.state_dict().items())
    one_bucket = sum(t.numel() * t.element_size() for _, t in state) * 2
    report = SharedMemoryBridge([ModuleTarget(tiny_dit(1))], bucket_bytes=one_bucket, checksum=checksum).push(state)
    assert report.verified and report.checksum == checksum and report.num_buckets == 1
    assert len(next(iter(report.expected_digests.values()))) == {"xxh3": 32, "sha256": 64}[checksum]
    with pytest.raises(SyncError, match="differs from what was sent"):
        SharedMemoryBridge([_DamagedInFlight(tiny_dit(1), damage)], bucket_bytes=one_bucket,
                        checksum=checksum).push(state)

@pytest.fixture
def hash_calls(monkeypatch):
    """Counts hash passes: the bridge's (from each packed bucket) and the targets' (re-hash), by tensor."""
    import megaflow.bridge.buckets as buckets
    import megaflow.bridge.target as target
    calls = {"bridge": [], "engine": []}
    real_bucket_digests, real_tensor_digest = buckets.Bucket.digests, target.tensor_digest

    def bucket_digests(self, checksum):
        calls["bridge"].extend(m.shape for m in self.metadata)
        return real_bucket_digests(self, checksum)

    def tensor_digest(t, checksum):
        calls["engine"].append(tuple(t.shape))
        return real_tensor_digest(t, checksum)
    monkeypatch.setattr(buckets.Bucket, "digests", bucket_digests)
    monkeypatch.setattr(target, "tensor_digest", tensor_digest)
    return calls


@pytest.mark.parametrize("mode", ["shared_memory", "disk"])
def test_verify_false_hashes_nothing_true_hashes_once(mode, hash_calls, tmp_path):
    src, dst1, dst2 = tiny_dit(0), tiny_dit(1), tiny_dit(2)
    n = len(src.state_dict())
    targets = [ModuleTarget(dst1), ModuleTarget(dst2)]

    def bridge(verify):
        if mode == "shared_memory":
            return SharedMemoryBridge(targets, bucket_bytes=4 << 10, verify=verify)
        return DiskBridge(targets, tmp_path / "sync", bucket_bytes=4 << 10, verify=verify)
    report = bridge(False).push(src.state_dict().items())
    assert not report.verified and hash_calls == {"bridge": [], "engine": []}
    assert all(torch.equal(v, dst1.state_dict()[k]) for k, v in src.state_dict().items())
    report = bridge(True).push(src.state_dict().items())
    assert report.verified
    assert len(hash_calls["bridge"]) == n  # one pass per tensor per sync on the sending side
    assert len(hash_calls["engine"]) == 2 * n  # and one per tensor in each of the two engines


def test_verify_false_lets_a_lossy_transfer_through_true_catches_it(hash_calls):
    src = tiny_dit(0)
    SharedMemoryBridge([_Corrupting(tiny_dit(1))], verify=False).push(src.state_dict().items())
    with pytest.raises(SyncError, match="proj_out.bias"):
        SharedMemoryBridge([_Corrupting(tiny_dit(1))], verify=True).push(src.state_dict().items())


def test_disk_push_atomic_and_pruned(tmp_path):
    src, dst = tiny_dit(0), tiny_dit(1)
    bridge = DiskBridge([ModuleTarget(dst)], tmp_path / "sync", bucket_bytes=16 << 10, keep=1,
                        transformer_config=dict(src.config))
    r1 = bridge.push(src.state_dict().items())
    assert r1.verified and r1.num_buckets > 1
    r2 = bridge.push(src.state_dict().items())
    snaps = sorted(p.name for p in (tmp_path / "sync").iterdir())
    assert snaps == ["sync-000002"], snaps
    assert (tmp_path / "sync" / "sync-000002" / "transformer" / "config.json").is_file()
    assert r2.verified and all(torch.equal(v, dst.state_dict()[k]) for k, v in src.state_dict().items())
    with pytest.raises(ValueError, match="no tensors"):
        bridge.push(iter([]))
    assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["sync-000002"], "failed sync left files"


def _distributed_worker():
    import os

    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])

    from megaflow.bridge.distributed import DistributedBridge, DistributedReceiver
    src = tiny_dit(0)
    if rank == 0:
        report = DistributedBridge(bucket_bytes=8 << 10).push(src.state_dict().items())
        dist.barrier()
        return {"verified": report.verified, "buckets": report.num_buckets}
    dst = tiny_dit(rank)
    ok, msg = DistributedReceiver([ModuleTarget(dst)]).receive()
    equal = all(torch.equal(v, dst.state_dict()[k]) for k, v in src.state_dict().items())
    dist.barrier()
    return {"ok": ok, "equal": equal, "msg": msg}


@pytest.mark.slow
@pytest.mark.dist
def test_distributed_push_to_two_receivers():
    from megaflow.testing.dist import run_multiprocess
    results = run_multiprocess(_distributed_worker, 3, timeout_s=180)
    assert results[0]["verified"] and results[0]["buckets"] > 1
    for r in results[1:]:
        assert r["ok"] and r["equal"], r
