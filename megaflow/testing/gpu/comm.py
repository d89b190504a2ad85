"""GPU checks of the communication paths, without SGLang. Design notes: docs/design/testing.md."""
from __future__ import annotations

import time

from megaflow.testing.gpu.common import error_line, probe_import, require_cuda


def _named_tensors(device, seed: int, n: int = 12, width: int = 512) -> list:
    """Mixed-dtype named tensors (fp32 weights, bf16 weights, fp32 vectors) on ``device``."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for i in range(n):
        dtype = torch.bfloat16 if i % 3 == 1 else torch.float32
        shape = (width,) if i % 3 == 2 else (width, width + 16 * i)
        out.append((f"w{i}", torch.randn(shape, generator=g).to(device=device, dtype=dtype)))
    return out


class _Holder:
    """A module holding zero tensors with given names/shapes/dtypes (the engine side's DiT stand-in)."""

    @staticmethod
    def build(spec: list, device):
        import torch

        module = torch.nn.Module()
        for name, shape, dtype in spec:
            module.register_parameter(name, torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device),
                                                               requires_grad=False))
        return module


def _push_ok(report, targets: dict, sent: list) -> dict:
    import torch

    exact = all(torch.equal(targets[n], t) for n, t in sent)
    return {"verified": bool(report.verified), "exact": exact, "tensors": report.num_tensors,
            "buckets": report.num_buckets, "mbytes": round(report.num_bytes / 2**20, 2),
            "push_s": round(report.seconds, 4), "message": report.message}


def nccl() -> dict:
    """Collectives and the distributed bridge in a 1-process NCCL world."""
    require_cuda()
    import torch

    torch.cuda.set_device(0)
    rec = collectives_and_bridge(torch.device("cuda", 0), "nccl")
    rec["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return rec


def collectives_and_bridge(dev, backend: str) -> dict:
    """``nccl``'s body for any device/backend (the CPU test runs it with gloo)."""
    import torch
    import torch.distributed as dist

    from megaflow.bridge.distributed import DistributedBridge
    from megaflow.bridge.target import ModuleTarget
    from megaflow.testing.dist import free_port

    t0 = time.perf_counter()
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            **({"device_id": dev} if dev.type == "cuda" else {}))
    try:
        x = torch.arange(1 << 20, dtype=torch.float32, device=dev)
        dist.broadcast(x, src=0)
        y = torch.full((1 << 20,), 3.0, device=dev)
        dist.all_reduce(y)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        coll = {"broadcast_ok": bool(torch.equal(x, torch.arange(1 << 20, dtype=torch.float32, device=dev))),
                "all_reduce_ok": bool((y == 3.0).all()), "init_and_collectives_s": round(time.perf_counter() - t0, 3)}
        sent = _named_tensors(dev, seed=1)
        module = _Holder.build([(n, tuple(t.shape), t.dtype) for n, t in sent], dev)
        bridge = DistributedBridge(group=None, src=0, bucket_bytes=2 << 20, verify=True, device=dev,
                                   engines=[ModuleTarget(module, "local")])
        push = _push_ok(bridge.push(sent), dict(module.named_parameters()), sent)
    finally:
        dist.destroy_process_group()
    ok = coll["broadcast_ok"] and coll["all_reduce_ok"] and push["verified"] and push["exact"]
    return {"status": "pass" if ok else "fail", "backend": backend, **coll, "distributed_bridge": push,
            "headline": f"collectives ok={coll['broadcast_ok'] and coll['all_reduce_ok']}, "
                        f"bridge verified={push['verified']} exact={push['exact']} ({push['buckets']} buckets)"}


def _gpu_uuid(device) -> str:
    """The physical GPU's UUID as torch reports it (``megaflow.rollout.sglang.weights.gpu_uuid``, which needs
    SGLang to import)."""
    import torch

    return str(torch.cuda.get_device_properties(device).uuid)


def _engine_child(requests, replies, spec: list, device: str) -> None:
    """The engine stand-in (spawned): loads IPC buckets (CUDA IPC; shared memory on CPU) into its own module on
    ``device``, verifies on request."""
    import torch

    from megaflow.bridge.buckets import Bucket
    from megaflow.bridge.target import ModuleTarget

    target = ModuleTarget(_Holder.build(spec, torch.device(device)), "ipc-child")
    replies.put(("ready",))  # the parent times pushes only from here (start, imports, CUDA context are not a push)
    while True:
        msg = requests.get()
        if msg[0] == "stop":
            return
        if msg[0] == "verify":
            replies.put(target.verify_weights(msg[1], checksum=msg[2]))
        elif msg[0] == "load":
            _, flat, metadata, sender_uuid = msg
            if flat.is_cuda and _gpu_uuid(flat.device) != sender_uuid:
                replies.put((False, f"GPU UUID {_gpu_uuid(flat.device)} is not the sender's {sender_uuid}", 0))
            else:
                r = target.load_bucket(Bucket(flat=flat, metadata=metadata))
                if flat.is_cuda:
                    torch.cuda.synchronize()
                replies.put((r.ok, r.message, r.num_bytes))
            del flat
        elif msg[0] == "payload":
            replies.put(_read_sglang_payload(msg[1]))


def _read_sglang_payload(serialized: str):
    """(sha256 of the payload's flat bytes, its device's UUID) from an SGLang update request's serialized payload."""
    import hashlib

    from sglang.srt.utils import MultiprocessingSerializer

    payload = MultiprocessingSerializer.deserialize(serialized)["transformer"]
    flat = payload["flattened_tensor"]
    return hashlib.sha256(flat.cpu().numpy().tobytes()).hexdigest(), _gpu_uuid(flat.device)


class _IPCEngine:
    """Parent side of the child: the engine methods ``SharedMemoryBridge`` calls."""

    engine_id = "ipc-child"

    def __init__(self, requests, replies, uuid: str):
        self.requests, self.replies, self.uuid = requests, replies, uuid

    def load_bucket(self, bucket, *, digests: dict | None = None, checksum: str = "xxh3"):
        """Load in the child, then (``digests``) have the child re-hash what it holds against them."""
        from megaflow.bridge.base import WeightUpdateResult

        self.requests.put(("load", bucket.flat, bucket.metadata, self.uuid))
        ok, message, nbytes = self.replies.get(timeout=60)
        if ok and digests:
            ok, message = self.verify_weights(digests, checksum=checksum)
        return WeightUpdateResult(ok=ok, num_bytes=nbytes, message=message)

    def verify_weights(self, expected_digests: dict, *, checksum: str = "xxh3") -> tuple[bool, str]:
        self.requests.put(("verify", expected_digests, checksum))
        return self.replies.get(timeout=60)


def cuda_ipc() -> dict:
    """SharedMemoryBridge -> CUDA IPC -> a child process's CUDA module, verified; the SGLang payload if it imports."""
    require_cuda()
    import torch

    return colocated_to_child(torch.device("cuda", 0))


def colocated_to_child(dev, pushes: int = 4) -> dict:
    """``cuda_ipc``'s body for any device (on CPU the buckets travel as shared memory; the CPU test runs it):
    ``pushes`` verified pushes once the child is ready, the first and the steady ones apart."""
    import torch.multiprocessing as mp

    from megaflow.bridge.shared_memory import SharedMemoryBridge
    from megaflow.checksum import WSUM
    from megaflow.testing.gpu.pushes import copy_seconds, push_record

    sent = _named_tensors(dev, seed=2)
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    spec = [(n, tuple(t.shape), t.dtype) for n, t in sent]
    child = ctx.Process(target=_engine_child, args=(requests, replies, spec, str(dev)), daemon=True)
    child.start()
    try:
        if replies.get(timeout=300) != ("ready",):
            raise RuntimeError("the engine stand-in did not start")
        engine = _IPCEngine(requests, replies, _gpu_uuid(dev) if dev.type == "cuda" else "")
        bridge = SharedMemoryBridge([engine], bucket_bytes=2 << 20, verify=True)
        reports = [bridge.push(sent) for _ in range(pushes)]
        report = reports[-1]
        push = {"verified": all(r.verified for r in reports), "tensors": report.num_tensors,
                "buckets": report.num_buckets, "mbytes": round(report.num_bytes / 2**20, 2),
                "push_s": round(report.seconds, 4), "message": report.message,
                "digests_on_device": all(d.startswith(WSUM) for d in report.expected_digests.values()),
                **push_record([r.seconds for r in reports], report.num_bytes, copy_seconds(report.num_bytes, dev))}
        sglang = _sglang_payload(sent, requests, replies) if dev.type == "cuda" else \
            {"status": "skipped", "reason": "not a CUDA device"}
    finally:
        requests.put(("stop",))
        child.join(timeout=20)
        if child.is_alive():
            child.kill()
    ok = push["verified"] and (dev.type != "cuda" or push["digests_on_device"]) and sglang.get("status") != "fail"
    return {"status": "pass" if ok else "fail", "device": str(dev), "colocated_bridge": push, "sglang_payload": sglang,
            "headline": f"shared-memory bridge to a child process verified={push['verified']} ({push['buckets']} "
                        f"buckets): first push {push['first_push_s']} s, steady {push['push_gb_per_s']} GB/s vs "
                        f"copy {push['copy_gb_per_s']} GB/s; sglang payload: {sglang['status']}"}


def _sglang_payload(sent: list, requests, replies) -> dict:
    """SGLang's update request for one CUDA bucket, deserialized in the child: same bytes, same GPU."""
    found = probe_import("sglang", really=True)
    if not found["ok"]:
        return {"status": "skipped", "reason": f"sglang does not import: {found['error']}"}
    import hashlib

    from megaflow.bridge.buckets import pack

    try:
        from megaflow.rollout.sglang.weights import gpu_uuid, update_request

        bucket = pack(sent[:3])
        req = update_request(bucket.flat, bucket.metadata)
        requests.put(("payload", req.serialized_named_tensors[0]))
        digest, uuid = replies.get(timeout=60)
    except Exception as e:  # noqa: BLE001 - reported in the record
        return {"status": "fail", "error": error_line(e)}
    same = digest == hashlib.sha256(bucket.flat.cpu().numpy().tobytes()).hexdigest()
    same_gpu = uuid == gpu_uuid(bucket.flat.device) and list(req.payload_gpu_uuids or []) == [uuid]
    return {"status": "pass" if same and same_gpu else "fail", "same_bytes": same, "same_gpu": same_gpu}
