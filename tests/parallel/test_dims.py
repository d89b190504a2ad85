"""ParallelDims validation and dp_for (CPU, 1 process, no torch.distributed)."""
import dataclasses

import pytest

from megaflow.parallel.dims import ParallelDims


def test_defaults_are_single_process():
    dims = ParallelDims()
    assert (dims.tp, dims.pp, dims.cp, dims.sp, dims.vpp) == (1, 1, 1, False, None)
    assert dims.dp_for(1) == 1 and dims.dp_for(4) == 4


@pytest.mark.parametrize(
    "kwargs, world, dp",
    [(dict(tp=2), 2, 1), (dict(tp=2, sp=True), 8, 4), (dict(tp=2, pp=2), 8, 2),
     (dict(pp=2, vpp=2), 4, 2), (dict(tp=2, cp=2), 8, 2)],
)
def test_dp_for(kwargs, world, dp):
    assert ParallelDims(**kwargs).dp_for(world) == dp


@pytest.mark.parametrize("world", [1, 3, 0, -4])
def test_dp_for_rejects_world_that_does_not_fit(world):
    with pytest.raises(ValueError, match=f"world_size={world}"):
        ParallelDims(tp=2, pp=2).dp_for(world)


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(tp=0), "tp"), (dict(pp=-1), "pp"), (dict(cp=1.5), "cp"), (dict(sp=True), "sp = true"),
     (dict(sp=True, tp=1), "tp = 1"), (dict(vpp=2), "vpp = 2"), (dict(pp=2, vpp=0), "vpp")],
)
def test_invalid_dims_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(**kwargs)


def test_kw_only_and_frozen():
    with pytest.raises(TypeError):
        ParallelDims(2)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ParallelDims().tp = 2  # type: ignore[misc]
