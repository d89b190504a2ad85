"""CIFAR-10 reward: the Keras->torch port matches a numpy re-implementation of the Keras layers
(read straight from the .h5, channels-last) and makes sensible predictions on constructed images.
Needs: CPU, 1 process, the `cifar-10-model` package (installed --no-deps by scripts/setup_env.sh)."""
import json

import h5py
import numpy as np
import pytest
import torch

from megaflow.rewards import build_reward, safe_score
from megaflow.rewards.cifar import CLASSES, Cifar10Reward, class_in_prompt, load_cifar10_cnn, weights_path

torch.set_num_threads(1)


def _keras_forward_numpy(x_nhwc: np.ndarray) -> np.ndarray:
    """Keras inference semantics in numpy, NHWC, straight from the HDF5 file."""
    with h5py.File(weights_path(), "r") as f:
        layers = json.loads(f.attrs["model_config"])["config"]["layers"]
        w = f["model_weights"]
        for layer in layers:
            cfg, cls = layer["config"], layer["class_name"]
            get = (lambda k, n=cfg["name"]: np.asarray(w[n][f"{n}/{k}:0"], np.float64))
            if cls == "Conv2D":
                k, b = get("kernel"), get("bias")
                kh, kw = k.shape[:2]
                h, wd = x_nhwc.shape[1] - kh + 1, x_nhwc.shape[2] - kw + 1
                out = np.zeros(x_nhwc.shape[:1] + (h, wd, k.shape[3]))
                for i in range(kh):
                    for j in range(kw):
                        out += x_nhwc[:, i:i + h, j:j + wd, :] @ k[i, j]
                x_nhwc = np.maximum(out + b, 0.0)
            elif cls == "BatchNormalization":
                x_nhwc = (x_nhwc - get("moving_mean")) / np.sqrt(get("moving_variance") + cfg["epsilon"]) \
                    * get("gamma") + get("beta")
            elif cls == "MaxPooling2D":
                p, s = cfg["pool_size"][0], cfg["strides"][0]
                n, h, wd, c = x_nhwc.shape
                oh, ow = (h - p) // s + 1, (wd - p) // s + 1
                x_nhwc = np.stack([np.stack([x_nhwc[:, y * s:y * s + p, z * s:z * s + p].max((1, 2))
                                             for z in range(ow)], 1) for y in range(oh)], 1)
            elif cls == "Flatten":
                x_nhwc = x_nhwc.reshape(len(x_nhwc), -1)
            elif cls == "Dense":
                x_nhwc = np.maximum(x_nhwc @ get("kernel") + get("bias"), 0.0)
    return x_nhwc


def _two_tone(top, bottom):
    x = torch.zeros(3, 32, 32)
    x[:, :16] = torch.tensor(top)[:, None, None]
    x[:, 16:] = torch.tensor(bottom)[:, None, None]
    return x


def test_port_matches_numpy_keras_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4, 3, 32, 32, generator=g)
    x[3] = _two_tone((0.6, 0.8, 1.0), (0.1, 0.3, 0.6))
    model = load_cifar10_cnn()
    got = model(x * 255).double().numpy()
    ref = _keras_forward_numpy((x * 255).permute(0, 2, 3, 1).double().numpy())
    assert got.shape == (4, 10)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-3 * np.abs(ref).max())


def test_predictions_are_sensible_on_constructed_scenes():
    reward = Cifar10Reward()
    sky_sea = _two_tone((0.6, 0.8, 1.0), (0.1, 0.3, 0.6))
    sky = _two_tone((0.5, 0.7, 0.95), (0.5, 0.7, 0.95))
    plane = sky.clone()
    plane[:, 12:20, 8:24] = 0.3  # a dark elongated blob in the sky
    field = _two_tone((0.2, 0.5, 0.2), (0.3, 0.6, 0.2))
    probs = reward.probs(torch.stack([sky_sea, sky, plane, field, plane.flip(0)]))
    assert torch.allclose(probs.sum(-1), torch.ones(5), atol=1e-5)
    top = [CLASSES[i] for i in probs.argmax(-1)]
    assert top[:3] == ["ship", "airplane", "airplane"]  # sky over water; plain sky; blob in the sky
    assert probs[2, 0] > 0.7
    assert top[3] in ("deer", "frog", "horse", "bird")  # green field: an animal class
    assert probs[4, 0] < 0.5 * probs[2, 0]  # BGR input breaks it: channel order matters
    # Upsampled input is resized to 32x32 and gives the same class.
    big = torch.nn.functional.interpolate(sky_sea[None], size=64, mode="nearest")
    assert CLASSES[int(reward.probs(big).argmax())] == "ship"


def test_reward_target_from_prompt_config_and_masking():
    imgs = torch.stack([_two_tone((0.6, 0.8, 1.0), (0.1, 0.3, 0.6))] * 3)
    by_prompt = build_reward("cifar10")(imgs, ["a ship at sea", "a photo of a boat", "a truck"])
    assert by_prompt[0] == by_prompt[1] > 0.9 and by_prompt[2] < 0.1
    fixed = build_reward("cifar10", target="truck")(imgs, ["a ship"] * 3)
    assert torch.allclose(fixed, by_prompt[2].expand(3))
    out = safe_score(build_reward("cifar10"), imgs, ["ship", "a red circle", "cars"])
    assert torch.isnan(out[1]) and torch.isfinite(out[[0, 2]]).all()
    assert class_in_prompt("two cars") == CLASSES.index("automobile")
    with pytest.raises(ValueError, match="CIFAR-10 class"):
        build_reward("cifar10", target="zebra")
