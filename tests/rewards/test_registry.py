"""Reward registry: known names, custom rewards by dotted path, one-line ValueErrors for bad
config. Needs: CPU, 1 process."""
import itertools

import pytest
import torch

from megaflow.config.preflight import SERVER_REWARDS
from megaflow.config.reward_files import MODEL_REWARDS
from megaflow.rewards import REWARDS, RewardSpec, build_multi_reward, build_reward
from megaflow.rewards.jpeg import jpeg_size_kb

torch.set_num_threads(1)
_counter = itertools.count()

CUSTOM = '''
import torch

def brightness(images, prompts, metadata, scale=1.0):
    return scale * images.flatten(1).mean(1)

class Darkness:
    def __init__(self, *, offset=0.0):
        self.offset = offset
    def __call__(self, images, prompts, metadata=None):
        return self.offset - images.flatten(1).mean(1)

NOT_CALLABLE = 3
'''


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    name = f"megaflow_test_custom_rewards_{next(_counter)}"
    (tmp_path / f"{name}.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_every_registered_reward_builds_and_scores():
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    prompts = ["a red circle", "two blue squares"]
    kwargs = {"cifar10": {"target": "ship"}}  # the prompts name no CIFAR class
    metadata = {"ocr": [{"text": "circle"}, {"text": "squares"}]}  # nor quoted text
    for name in REWARDS:
        if name in SERVER_REWARDS:  # need a server: tests/rewards/test_remote.py runs them against loopback ones
            continue
        if name in MODEL_REWARDS:  # need model files: tests/rewards/test_clip_rewards.py builds tiny ones
            continue
        out = build_reward(name, **kwargs.get(name, {}))(x, prompts, metadata.get(name))
        assert out.shape == (2,) and out.dtype == torch.float32, name


def test_custom_function_and_class_by_dotted_path(custom_module):
    x = torch.stack([torch.full((3, 8, 8), 0.2), torch.full((3, 8, 8), 0.6)])
    fn = build_reward(f"{custom_module}:brightness", scale=2.0)
    assert torch.allclose(fn(x, ["", ""]), torch.tensor([0.4, 1.2]))
    cls = build_reward(f"{custom_module}:Darkness", offset=1.0)
    assert torch.allclose(cls(x, ["", ""]), torch.tensor([0.8, 0.4]))
    multi = build_multi_reward([{"name": f"{custom_module}:brightness", "weight": 0.5},
                                RewardSpec(name=f"{custom_module}:Darkness", label="dark")])
    scores = multi.score(x, ["", ""])
    assert set(scores.components) == {f"{custom_module}:brightness", "dark"}
    assert torch.allclose(scores.total, 0.5 * torch.tensor([0.2, 0.6]) - torch.tensor([0.2, 0.6]))


@pytest.mark.parametrize("name, kwargs, needle", [
    ("nosuch", {}, "unknown reward 'nosuch'"),
    ("no_such_pkg.mod:fn", {}, "cannot import module 'no_such_pkg.mod'"),
    ("megaflow.rewards.jpeg:nope", {}, "has no attribute 'nope'"),
    ("megaflow.rewards.jpeg:", {}, "bad reward path"),
    (":fn", {}, "bad reward path"),
    ("jpeg_compressibility", {"qualty": 90}, "bad arguments"),
    ("jpeg_compressibility", {"quality": 0}, "JPEG quality"),
])
def test_bad_config_raises_one_line_value_error(name, kwargs, needle):
    with pytest.raises(ValueError) as exc:
        build_reward(name, **kwargs)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_bad_custom_targets(custom_module):
    with pytest.raises(ValueError, match="not callable"):
        build_reward(f"{custom_module}:NOT_CALLABLE")
    with pytest.raises(ValueError, match="bad arguments"):
        build_reward(f"{custom_module}:Darkness", scale=2)


def test_multi_reward_from_config_weights_table():
    multi = build_multi_reward({"jpeg_compressibility": 2.0, "color_target": 0.5},
                               kwargs={"color_target": {"target": "red"}})
    x = torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    scores = multi.score(x, ["a", "b", "c"])
    jpeg = -jpeg_size_kb(x)
    color = build_reward("color_target", target="red")(x, ["a", "b", "c"])
    assert torch.allclose(scores.components["jpeg_compressibility"], jpeg)
    assert torch.allclose(scores.components["color_target"], color)
    assert torch.allclose(scores.total, 2.0 * jpeg + 0.5 * color)
    assert scores.weights == {"jpeg_compressibility": 2.0, "color_target": 0.5}
    with pytest.raises(ValueError, match="no weight"):
        build_multi_reward({"jpeg_compressibility": 1.0}, kwargs={"cifar10": {}})
    with pytest.raises(ValueError, match="duplicate"):
        build_multi_reward([{"name": "shapeeval"}, {"name": "shapeeval"}])
    with pytest.raises(ValueError, match="unknown reward spec key"):
        build_multi_reward([{"name": "shapeeval", "wieght": 1.0}])
    with pytest.raises(ValueError, match="weight"):
        build_multi_reward({"shapeeval": "heavy"})
