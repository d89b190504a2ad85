"""The rewards of a config, checked before anything starts with the standard library only (preflight calls
:func:`check_rewards`): their names, their argument tables, each built-in reward's own arguments where a mistake
would otherwise surface only once the engines run (``color_target``'s colour), a server reward's URL and trust
flag, a model reward's files and device.
"""
from __future__ import annotations

import socket
import urllib.parse
from collections.abc import Callable

from megaflow.config.dotted import is_dotted_path, unfindable
from megaflow.config.load import ConfigError
from megaflow.config.reward_files import MODEL_REWARDS, check_model_reward
from megaflow.config.schema import MegaflowConfig
from megaflow.data.colors import parse_color

# Names of megaflow.rewards.registry.REWARDS (which imports torch; tests/config/test_preflight.py checks them).
REWARD_NAMES = ("jpeg_compressibility", "jpeg_incompressibility", "color_target", "shapeeval",
                "shapeeval_partial", "cifar10", "ocr", "remote", "remote_json", "vlm_judge", "clipscore",
                "pickscore", "aesthetic", "imagereward", "hpsv2")
SERVER_REWARDS = ("remote", "remote_json", "vlm_judge")  # megaflow.rewards.remote: scored by a server at 'url'
SERVER_PROBE_S = 3.0  # seconds a TCP connect to a reward server may take in preflight


def check_rewards(cfg: MegaflowConfig, *, probe: bool, files: bool, cuda_available: Callable[[], bool]) -> None:
    """``reward.weights`` and ``reward.kwargs``: known names or findable 'pkg.module:callable's, a table of
    arguments per named reward, each built-in reward's own arguments (``BUILTIN_ARGS``), a server reward's URL
    (``probe``: reachable), a model reward's files (``files``) and device (``cuda_available``)."""
    r = cfg.reward
    if not r.weights:
        raise ConfigError("reward.weights is empty: name at least one reward")
    for name in r.weights:
        if ":" in name:
            if not is_dotted_path(name):
                raise ConfigError(f"reward.weights: {name!r} is not a well-formed 'pkg.module:callable'")
            if files and (missing := unfindable(name)):
                raise ConfigError(f"reward.weights: {name!r}: no module {missing!r} on this Python path")
        elif name not in REWARD_NAMES:
            raise ConfigError(f"reward.weights: unknown reward {name!r} (known: {', '.join(REWARD_NAMES)}; "
                              "or 'pkg.module:callable')")
    for name, kwargs in r.kwargs.items():
        if name not in r.weights:
            raise ConfigError(f"reward.kwargs.{name}: no reward {name!r} in reward.weights "
                              f"({', '.join(r.weights)})")
        if not isinstance(kwargs, dict):
            raise ConfigError(f"reward.kwargs.{name}: expected a table of arguments, got {kwargs!r}")
    for name in r.weights:
        if name in SERVER_REWARDS:
            _check_server_reward(name, r.kwargs.get(name, {}), probe=probe)
        elif name in BUILTIN_ARGS:
            BUILTIN_ARGS[name](f"reward.kwargs.{name}", r.kwargs.get(name, {}))
        elif name in MODEL_REWARDS:  # megaflow.rewards.clip / aesthetic / imagereward / hps: local files, a device
            device = r.kwargs.get(name, {}).get("device", "cpu")  # the GPU is the run's machine's, like the files
            if files and isinstance(device, str) and device.startswith("cuda") and not cuda_available():
                raise ConfigError(f"reward.kwargs.{name}.device = {device!r} but this machine has no visible CUDA "
                                  "device (use 'cpu')")
            if files:
                check_model_reward(name, r.kwargs.get(name, {}))


def _check_server_reward(name: str, kwargs: dict, *, probe: bool) -> None:
    """A remote reward's url (and, with ``probe``, that a TCP connect to it succeeds within SERVER_PROBE_S),
    the pickle trust flag, the judge's model."""
    url = kwargs.get("url")
    parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"reward.kwargs.{name}.url: the {name} reward needs its server's http(s) URL, "
                          f"got {url!r}")
    if name == "remote" and kwargs.get("format", "pickle") == "pickle" and kwargs.get("trust_pickle") is not True:
        raise ConfigError(f"reward.kwargs.{name}.trust_pickle: the pickle protocol runs code the server sends; "
                          "set it to true for a server you trust, or use format = \"json\" (or 'remote_json')")
    if name == "vlm_judge" and not kwargs.get("model"):
        raise ConfigError(f"reward.kwargs.{name}.model: name the model the server serves")
    if probe:
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as e:
            raise ConfigError(f"reward.kwargs.{name}.url: {e} in {url!r}") from None
        try:
            socket.create_connection((parts.hostname, port), timeout=SERVER_PROBE_S).close()
        except OSError as e:
            raise ConfigError(f"reward.kwargs.{name}.url: cannot reach {parts.hostname}:{port} ({e}); start the "
                              "reward server first or fix the URL") from None


def _check_color_args(where: str, kwargs: dict) -> None:
    """``color_target``: only ``target``, a colour megaflow.data.colors reads (``where``: the arguments' key)."""
    unknown = sorted(set(kwargs) - {"target"})
    if unknown:
        raise ConfigError(f"{where}: unknown argument {unknown[0]!r} (color_target takes only 'target')")
    if kwargs.get("target") is not None:
        try:
            parse_color(kwargs["target"])
        except ValueError as e:
            raise ConfigError(f"{where}.target: {e}") from None


# built-in reward -> check(where, its kwargs): what its constructor would refuse, told without torch
BUILTIN_ARGS: dict[str, Callable[[str, dict], None]] = {"color_target": _check_color_args}
