"""GPU check of the trainer offload (``train.offload``, a phased run): an SD3.5-M-shaped trainer's states and
weights to pinned host memory and back; bytes, seconds, CUDA memory, an exact round-trip checksum and the loss
after. Details: docs/design/testing.md.
"""
from __future__ import annotations

from megaflow.testing.gpu.common import require_cuda, require_module

PLAN_ITEMS = {"states": ("grads (fp32 buffer)", "optimizer (Adam, /dp)"), "weights": ("weights",)}
"""``megaflow plan``'s trainer items that each offloaded part holds."""
CHUNK = 1 << 26
"""Elements per slice of a storage's checksum (bounds the int64 temporary)."""


def offload() -> dict:
    require_cuda()
    require_module("megatron.core")
    import torch

    return measure_offload(torch.device("cuda", 0))


def checksums(tensors) -> list[tuple[int, int]]:
    """Per distinct storage of ``tensors``: (sum, sum of squares) of its bytes read as int16, in int64."""
    import torch

    seen, out = set(), []
    for t in tensors:
        s = t.untyped_storage()
        if s._cdata in seen or s.nbytes() == 0:
            continue
        seen.add(s._cdata)
        words = torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)[: s.nbytes() // 2 * 2].view(torch.int16)
        total = squares = 0
        for i in range(0, words.numel(), CHUNK):
            w = words[i:i + CHUNK].to(torch.int64)
            total, squares = total + int(w.sum()), squares + int((w * w).sum())
        out.append((total, squares))
    return out


def measure_offload(dev, conf: dict | None = None, rounds: int = 2) -> dict:
    """The check's body on ``dev`` (the CPU test runs a tiny ``conf`` through it; memory figures are 0 there).
    ``rounds`` round trips, a train step after each: the first allocates the pinned host buffers, the later ones
    reuse them (what every iteration of the loop costs)."""
    import megaflow  # noqa: F401
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import destroy_distributed, init_distributed
    from megaflow.plan.dit import BUILTIN
    from megaflow.testing.gpu import model
    from megaflow.trainer.offload import TrainerOffload, optimizer_tensors

    conf, cuda = conf or BUILTIN["sd3"][1], dev.type == "cuda"
    plan = model.predicted("full")
    init_distributed(ParallelDims(), seed=0)
    try:
        trainer, _ = model._trainer("full", conf)
        mb = model._microbatch(conf, plan["image_tokens"], plan["text_tokens"], dev)
        losses = [float(trainer.train_step([mb])["loss"]) for _ in range(2)]
        params = [p for m in trainer.model for p in m.parameters()]
        off, trips, exact = TrainerOffload(trainer, "all"), [], True
        for _ in range(rounds):
            before, memory, parts = checksums(params + optimizer_tensors(trainer.optimizer)), {"steady": _memory(cuda)}, {}
            for part in ("states", "weights"):
                parts[part] = off.offload([part])
                memory[f"after_{part}_offload"] = _memory(cuda)
            back = off.reload()
            memory["after_reload"] = _memory(cuda)
            exact = exact and checksums(params + optimizer_tensors(trainer.optimizer)) == before
            losses.append(float(trainer.train_step([mb])["loss"]))
            trips.append((parts, back, memory))
    finally:
        destroy_distributed()
    return _record(plan, trips, exact, losses)


def _memory(cuda: bool) -> dict:
    import torch

    if not cuda:
        return {"allocated_gib": 0.0, "reserved_gib": 0.0}
    torch.cuda.synchronize()
    return {"allocated_gib": torch.cuda.memory_allocated() / 2**30,
            "reserved_gib": torch.cuda.memory_reserved() / 2**30}


def _record(plan: dict, trips: list, exact: bool, losses: list) -> dict:
    gib = 2**30
    predicted = {p: sum(plan["items"][k] for k in keys) / gib for p, keys in PLAN_ITEMS.items()}
    rounds = [{"offload_gib": {p: r["bytes"] / gib for p, r in parts.items()},
               "offload_s": {p: round(r["seconds"], 3) for p, r in parts.items()},
               "reload_gib": back["bytes"] / gib, "reload_s": round(back["seconds"], 3), "memory": memory,
               "freed_allocated_gib": memory["steady"]["allocated_gib"] - memory["after_weights_offload"]["allocated_gib"]}
              for parts, back, memory in trips]
    finite = all(loss == loss and abs(loss) < float("inf") for loss in losses)
    balanced = all(back["bytes"] == sum(r["bytes"] for r in parts.values()) for parts, back, _ in trips)
    last = rounds[-1]
    moved, secs = last["offload_gib"], last["offload_s"]
    return {
        "status": "pass" if exact and finite and balanced else "fail", "exact_round_trip": exact,
        "losses": losses, "losses_finite": finite, "predicted_gib": predicted, "rounds": rounds,
        "headline": f"round {len(rounds)}: states {moved['states']:.1f} GiB (plan {predicted['states']:.1f}) in "
                    f"{secs['states']:.2f} s, weights {moved['weights']:.1f} GiB (plan {predicted['weights']:.1f}) "
                    f"in {secs['weights']:.2f} s, reload {last['reload_s']:.2f} s; freed "
                    f"{last['freed_allocated_gib']:.1f} GiB; exact {exact}",
    }
