"""train.offload: the trainer's optimizer states, grad buffers (and with "all" its weights) leave and come back
bit-exact (megaflow.trainer.offload). Needs: CPU, gloo world of 1 (a fresh process per launch).

For each optimizer layout (megatron's plain one over SingleRankDDP; the distributed one, whose params live in a
contiguous param buffer and whose main params are shard views of it): one step, snapshot, offload (the moved
storages really freed), reload (every tensor equal), a second step whose loss and weights equal those of a
trainer that never offloaded."""
import pytest

from megaflow.testing.dist import run_multiprocess

DCFG = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=16, out_channels=4,
            pos_embed_max_size=8)


def _trainer(state, distributed: bool):
    from megaflow.models.sd3 import from_diffusers
    from megaflow.trainer.runner import Trainer, adam_config
    eng = Trainer(from_diffusers(DCFG), spec="local",
                  optimizer_config=adam_config(lr=1e-3, weight_decay=1e-4, distributed=distributed))
    eng.load_diffusers_state_dict(state)
    return eng


def _tensors(eng) -> dict:
    """Every tensor the offload may move, by kind: param, main (an optimizer param sharing a weight's storage),
    state (optimizer state or own main param), grad (DDP grad buffer)."""
    from megaflow.trainer.offload import optimizer_tensors
    params = [p for m in eng.model for p in m.parameters()]
    weights = {p.untyped_storage()._cdata for p in params}
    out = {("param", i): p for i, p in enumerate(params)}
    out.update({("main" if t.untyped_storage()._cdata in weights else "state", i): t
                for i, t in enumerate(optimizer_tensors(eng.optimizer))})
    out.update({("grad", i): b.grad_data for i, b in enumerate(b for m in eng.model for b in m.buffers)})
    return out


def _round_trip(mode: str, distributed: bool, state, mbs) -> dict:
    import torch

    from megaflow.trainer.offload import TrainerOffload
    ref, eng = _trainer(state, distributed), _trainer(state, distributed)
    for e in (ref, eng):
        e.train_step(mbs)
    off = TrainerOffload(eng, mode)
    live = _tensors(eng)
    for m in eng.model:  # the offload drops the last step's grads first (every step starts so)
        m.zero_grad_buffer()
    snap = {k: t.detach().clone() for k, t in live.items()}
    moved = off.offload()
    freed = {k: t.untyped_storage().size() == 0 for k, t in live.items()}
    back = off.reload()
    equal = {k: torch.equal(live[k], snap[k]) for k in live}
    losses = [float(e.train_step(mbs)["loss"]) for e in (ref, eng)]
    weights_equal = all(a[0] == b[0] and torch.equal(a[1], b[1])
                        for a, b in zip(ref.iter_full_params(), eng.iter_full_params()))
    return {"moved": moved, "back": back, "freed": freed, "equal": equal, "losses": losses,
            "weights_equal": weights_equal}


def _offload_rank(mode: str) -> dict:
    import torch
    from diffusers import SD3Transformer2DModel

    import megaflow  # noqa: F401
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import init_distributed
    from megaflow.trainer.runner import rectified_flow_microbatch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    state = SD3Transformer2DModel(**DCFG).state_dict()
    g = torch.Generator().manual_seed(3)
    mbs = [rectified_flow_microbatch(torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g),
                                     torch.rand(2, generator=g), torch.randn(2, 6, 32, generator=g),
                                     torch.randn(2, 16, generator=g)) for _ in range(2)]
    init_distributed(ParallelDims())
    return {d: _round_trip(mode, d, state, mbs) for d in (False, True)}


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["optimizer", "all"])
def test_offload_round_trip_is_bit_exact(mode):
    (out,) = run_multiprocess(_offload_rank, 1, mode, timeout_s=300)
    for distributed, r in out.items():
        where = f"{mode}, distributed optimizer={distributed}"
        assert all(r["equal"].values()), (where, [k for k, v in r["equal"].items() if not v])
        kinds: dict = {}
        for (kind, _), freed in r["freed"].items():
            kinds.setdefault(kind, set()).add(freed)
        assert kinds["grad"] == {True} and kinds["state"] == {True}, (where, kinds)  # every one freed
        assert kinds["param"] == {mode == "all"}, (where, kinds)
        assert kinds["main"] == {mode == "all"}, (where, kinds)  # optimizer params that are (views of) weights
        assert r["moved"]["bytes"] > 0 and r["back"]["bytes"] == r["moved"]["bytes"], (where, r["moved"], r["back"])
        assert r["losses"][0] == r["losses"][1] and r["weights_equal"], (where, r["losses"])
