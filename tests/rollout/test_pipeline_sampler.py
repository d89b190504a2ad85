"""The diffusers pipeline sampler (``megaflow.rollout.pipeline_sampler``), the independent sampler of
``megaflow eval shapes --sampler diffusers``. Needs: CPU, 1 process, no sglang.

On a tiny SD3 pipeline built in memory, its images (diffusers' ``StableDiffusion3Pipeline.__call__``: its scheduler
and loop) equal those of megaflow's own ODE loop (``megaflow.rollout.baseline.DiffusersEngine``, megaflow.flow steps)
for the same requests, seeds and prompt length, to 1e-5: the two samplers share only the weights and the prompt
encoding. Requests it cannot run (SDE, guidance, another prompt length) are refused by name.
"""
from __future__ import annotations

import pytest
import torch

import megaflow  # noqa: F401
from megaflow.rollout.baseline import DiffusersEngine
from megaflow.rollout.pipeline_sampler import PipelineSampler
from megaflow.rollout.types import RolloutRequest

SEQ = 12


@pytest.fixture(scope="module")
def pipe():
    torch.set_num_threads(1)
    from megaflow.models.tiny_pipeline import build_sd3
    return build_sd3(seed=0)


def _req(prompt: str, seed: int, **kw) -> RolloutRequest:
    base = dict(prompt=prompt, num_outputs=2, seed=seed, num_steps=4, height=32, width=32, sde_type="ode",
                max_sequence_length=SEQ, request_id=f"r{seed}")
    return RolloutRequest(**{**base, **kw})


def test_images_equal_megaflows_ode_loop(pipe):
    requests = [_req("a red circle", 3), _req("two blue squares", 11), _req("a green triangle", 20, num_steps=6)]
    sampler = PipelineSampler(pipe, text_len=SEQ, batch_size=3)  # batches split across requests and step counts
    got = sampler.generate(requests)
    ref = DiffusersEngine(pipe).generate(requests)
    assert [(s.prompt, s.seed) for s in got] == [(t.prompt, t.seed) for t in ref]
    assert [s.seed for s in got] == [3, 4, 11, 12, 20, 21]
    for s, t in zip(got, ref):
        assert s.image.shape == (3, 32, 32)
        torch.testing.assert_close(s.image, t.image, rtol=0, atol=1e-5)
    assert float((got[0].image - got[1].image).abs().max()) > 1e-3  # the seeds matter


@pytest.mark.parametrize("kw, needle", [(dict(sde_type="sde"), "ODE requests"),
                                        (dict(do_cfg=True, guidance_scale=4.0), "without guidance"),
                                        (dict(max_sequence_length=20), "prompt length 20")])
def test_refuses_what_it_cannot_sample(pipe, kw, needle):
    with pytest.raises(ValueError, match=needle):
        PipelineSampler(pipe, text_len=SEQ).generate([_req("a red circle", 0, **kw)])
