"""``checksum.device_lanes`` / ``device_digest`` (the digest a GPU computes in place) on CPU tensors: the same torch
function, against a pure-Python reference of its definition; every flipped bit and a misplaced tensor caught; a
bucket's digests from one transfer; the bridge verifying by them. Needs: CPU, < 10 s."""
import pytest
import torch

from megaflow.bridge import Bucket, SyncError, pack
from megaflow.bridge.shared_memory import SharedMemoryBridge
from megaflow.bridge.target import ModuleTarget
from megaflow.checksum import WSUM, device_digest, device_lanes, digest_like, tensor_digest

P = 2**31 - 1


def _mix(x: int) -> int:
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & 0xFFFFFFFF
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _reference_lanes(t: torch.Tensor) -> list[int]:
    """The definition in Python integers: words w_i (16-bit signed, little-endian; an odd last byte alone), weight
    c_k(i mod 2^16) * s_k(i div 2^16) with c_k(j) = mix(j ^ a_k) mod (2^21 - 1) + 1, s_k(r) = mix(r ^ b_k) mod (P - 1)
    + 1."""
    raw = bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())
    words = [int.from_bytes(raw[i:i + 2], "little", signed=True) for i in range(0, len(raw) - 1, 2)]
    if len(raw) % 2:
        words.append(raw[-1])
    out = []
    for a, b in ((0x243F6A88, 0x85A308D3), (0x13198A2E, 0x03707344)):
        def weight(i):
            return (_mix((i % 65536) ^ a) % (2**21 - 1) + 1) * (_mix((i // 65536) ^ b) % (P - 1) + 1)
        out.append(sum(w * weight(i) for i, w in enumerate(words)) % P)
    return out


@pytest.mark.parametrize("make", [lambda: torch.randn(7, 5), lambda: torch.arange(9, dtype=torch.uint8),
                                  lambda: torch.randn(70001).to(torch.bfloat16),
                                  lambda: torch.randint(0, 255, (2 * 65536 + 3,), dtype=torch.uint8),
                                  lambda: torch.randn(3, 4)[:, 1],
                                  lambda: torch.tensor(3.5), lambda: torch.zeros(0)])
def test_lanes_equal_the_pure_python_definition(make):
    torch.manual_seed(0)
    t = make()
    assert device_lanes(t).tolist() == _reference_lanes(t)


def test_every_flipped_bit_changes_the_digest():
    torch.manual_seed(1)
    t = torch.randn(4, 5)
    base = device_digest(t)
    raw = t.view(torch.uint8).reshape(-1)
    for pos in range(raw.numel()):
        for bit in range(8):
            bad = raw.clone()
            bad[pos] ^= 1 << bit
            assert device_digest(bad.view(torch.float32).reshape(4, 5)) != base, (pos, bit)


def test_moved_bytes_dtype_and_shape_change_the_digest():
    torch.manual_seed(2)
    t = torch.randn(300, 300)
    base = device_digest(t)
    assert base.startswith(WSUM) and device_digest(t.clone()) == base
    assert device_digest(t.flip(0)) != base and device_digest(t.T.contiguous()) != base
    assert device_digest(t.reshape(900, 100)) != base and device_digest(t.view(torch.int32)) != base
    rolled = t.reshape(-1).roll(1).reshape(300, 300)  # every value one place later
    assert device_digest(rolled) != base


def test_bucket_device_digests_catch_a_misplaced_tensor():
    """Two same-shape tensors swapped in a bucket: each name's digest no longer matches."""
    torch.manual_seed(3)
    named = [("a", torch.randn(16, 8)), ("b", torch.randn(16, 8)), ("c", torch.randn(5))]
    bucket = pack(named)
    sent = bucket.device_digests()
    assert sent == {n: device_digest(t) for n, t in named}
    swapped = pack([("a", named[1][1]), ("b", named[0][1]), ("c", named[2][1])])
    got = swapped.device_digests()
    assert got["a"] != sent["a"] and got["b"] != sent["b"] and got["c"] == sent["c"]


def test_digest_like_follows_the_expected_kind():
    t = torch.randn(6, 3)
    assert digest_like(t, device_digest(t), "xxh3") == device_digest(t)
    assert digest_like(t, tensor_digest(t, "sha256"), "sha256") == tensor_digest(t, "sha256")


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.LayerNorm(40),
                               torch.nn.Linear(40, 8).to(torch.bfloat16))


class _FlippedInFlight(ModuleTarget):
    """Receives each bucket with one byte flipped mid-bucket (packed and hashed intact by the bridge)."""

    def load_bucket(self, bucket, **kw):
        flat = bucket.flat.clone()
        flat[flat.numel() // 2] ^= 0x01
        return super().load_bucket(Bucket(flat=flat, metadata=bucket.metadata), **kw)


@pytest.mark.parametrize("flip", [False, True])
def test_bridge_verifies_by_device_digests(monkeypatch, flip):
    """The bridge as it runs on a GPU (each bucket's digests from ``device_digests``), here on CPU buckets: the
    target re-hashes what it holds by the same function (``wsum:`` digests) and refuses a flipped byte."""
    monkeypatch.setattr(Bucket, "digests", lambda self, checksum: self.device_digests())
    state = list(_model(0).state_dict().items())
    target = (_FlippedInFlight if flip else ModuleTarget)(_model(1))
    bridge = SharedMemoryBridge([target], bucket_bytes=1 << 30)
    if flip:
        with pytest.raises(SyncError, match="differs from what was sent"):
            bridge.push(state)
        return
    report = bridge.push(state)
    assert report.verified and all(d.startswith(WSUM) for d in report.expected_digests.values())
    assert all(torch.equal(target.module.state_dict()[n], t) for n, t in state)
