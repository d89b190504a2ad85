"""``megaflow bench sync``'s parts without an engine: the model shape for ``--params``, the trainer side's phases
over real tensors, the phase arithmetic. Needs: CPU, < 15 s."""
import pytest
import torch

from megaflow.bench.sync_phases import Source, phase_seconds, time_rounds, trainer_phases


def _tiny_config(tmp_path):
    from megaflow.bench.sync import _dit_config
    from megaflow.models.tiny_pipeline import make_tiny_pipeline
    return _dit_config(make_tiny_pipeline("sd3", tmp_path / "t"), layers=1, heads=4, head_dim=16)


@pytest.mark.parametrize("params", [1.23e8, 1e9])
def test_shape_for_params_counts_like_diffusers(tmp_path, params):
    """The shape's parameter count (diffusers' own model on the meta device) is within half a block of the target."""
    from diffusers import SD3Transformer2DModel

    from megaflow.bench.sync import shape_for_params
    base = _tiny_config(tmp_path)
    shape = shape_for_params(params, base)
    cfg = {**base, "num_layers": shape["layers"], "num_attention_heads": shape["heads"],
           "attention_head_dim": shape["head_dim"], "caption_projection_dim": shape["heads"] * shape["head_dim"]}
    with torch.device("meta"):
        count = sum(p.numel() for p in SD3Transformer2DModel.from_config(cfg).parameters())
    block = 12 * (shape["heads"] * shape["head_dim"]) ** 2 * 2  # a joint block: ~12 h^2 a stream
    assert abs(count - params) <= block / 2 + 0.05 * params and shape["heads"] == (12 if params < 4e8 else 24)


def test_trainer_phases_stream_the_engine_tensors(tmp_path):
    """gather -> convert yields the engine's tensors, equal to the source; each phase runs and is timed."""
    from diffusers import SD3Transformer2DModel

    cfg = _tiny_config(tmp_path)
    torch.manual_seed(0)
    state = {n: t.detach().clone() for n, t in SD3Transformer2DModel.from_config(cfg).state_dict().items()}
    source = Source(state, cfg)
    streamed = dict(source.stream())
    assert streamed.keys() == state.keys() and all(torch.equal(streamed[n], t) for n, t in state.items())
    timed = time_rounds(trainer_phases(source, bucket_bytes=1 << 16, checksum="xxh3"), repeats=2)
    assert set(timed) == {"median", "fastest", "cpu"}
    assert set(timed["median"]) == {"copy", "gather", "gather_convert", "pack", "pack_digest"}
    assert all(timed["fastest"][k] <= v for k, v in timed["median"].items())


def test_phase_seconds_subtracts_what_each_push_includes():
    s = {"copy": 1.0, "gather": 0.1, "gather_convert": 0.3, "pack": 1.0, "pack_digest": 1.25, "no_verify": 2.5,
         "verify": 3.0}
    assert phase_seconds(s) == pytest.approx({"copy": 1.0, "gather": 0.1, "convert": 0.2, "pack": 1.0,
                                              "digest": 0.25, "push": 1.2, "verify": 0.5})
    assert phase_seconds({**s, "pack_digest": 0.9})["digest"] == 0.0  # noise never makes a phase negative
