"""The rewards a config or ``megaflow eval reward`` names, checked before anything starts: a built-in's name and
argument names (``REWARD_ARGS`` mirrors megaflow.rewards.registry; a test keeps them equal), a custom
``'pkg.mod:fn'`` resolved and bound in full. Every mistake is one ConfigError line, with a did-you-mean.
"""
from __future__ import annotations

import inspect
import socket
import urllib.parse
from collections.abc import Callable, Mapping

from megaflow.config.dotted import is_dotted_path, resolve, unfindable
from megaflow.config.load import ConfigError
from megaflow.config.machine import cuda_available
from megaflow.config.reward_files import MODEL_REWARDS, check_model_reward
from megaflow.config.schema import MegaflowConfig
from megaflow.config.suggest import did_you_mean
from megaflow.data.colors import parse_color

SERVER_REWARDS = ("remote", "remote_json", "vlm_judge")  # megaflow.rewards.remote: scored by a server at 'url'
SERVER_PROBE_S = 3.0  # seconds a TCP connect to a reward server may take in preflight

_REMOTE = ("timeout", "retries", "backoff", "jpeg_quality", "deadline", "max_answer_bytes")
REWARD_ARGS: dict[str, tuple[str, ...]] = {  # built-in reward -> the keyword arguments its constructor takes
    "jpeg_compressibility": ("quality",),
    "jpeg_incompressibility": ("quality",),
    "color_target": ("target",),
    "shapeeval": (),
    "shapeeval_partial": (),
    "cifar10": ("target",),
    "ocr": ("key", "threads"),
    "remote": ("url", "format", "trust_pickle", *_REMOTE),
    "remote_json": ("url", *_REMOTE),
    "vlm_judge": ("url", "model", "question", "timeout", "retries", "backoff", "max_score", "max_tokens",
                  "concurrency", "api_key_env", "deadline", "max_answer_bytes"),
    "clipscore": ("path", "device", "batch_size", "w", "prefix"),
    "pickscore": ("path", "processor_path", "device", "batch_size", "scale"),
    "aesthetic": ("clip_path", "head_path", "device", "batch_size"),
    "imagereward": ("path", "tokenizer_path", "device", "batch_size"),
    "hpsv2": ("path", "tokenizer_path", "device", "batch_size"),
}


def check_rewards(cfg: MegaflowConfig, *, probe: bool, files: bool = True) -> None:
    """The ``[reward]`` section (preflight): names, arguments, custom rewards resolved (``files``), a server
    reward's URL (reached with ``probe``), a model reward's files and device (``files``)."""
    r = cfg.reward
    if not r.weights:
        raise ConfigError("reward.weights is empty: name at least one reward")
    for name in r.weights:
        check_reward_name(name, "reward.weights: ")
        if ":" in name and files and (missing := unfindable(name)):
            raise ConfigError(f"reward.weights: {name!r}: no module {missing!r} on this Python path "
                              "(nor beside the config file)")
    for name, kwargs in r.kwargs.items():
        if name not in r.weights:
            raise ConfigError(f"reward.kwargs.{name}: no reward {name!r} in reward.weights "
                              f"({', '.join(r.weights)}){did_you_mean(name, r.weights)}")
        if not isinstance(kwargs, dict):
            raise ConfigError(f"reward.kwargs.{name}: expected a table of arguments, got {kwargs!r}")
    for name in r.weights:
        if ":" in name:
            if files:  # the module imported, the callable found, its arguments bound: not ~50 s later in the run
                check_custom_reward(name, r.kwargs.get(name, {}), "reward.weights: ")
            continue
        check_reward_kwargs(name, r.kwargs.get(name, {}), f"reward.kwargs.{name}.")
        if name in SERVER_REWARDS:
            _check_server_reward(name, r.kwargs.get(name, {}), probe=probe)
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


def check_reward_name(name: str, where: str) -> None:
    """A built-in reward name or a well-formed ``'pkg.module:callable'``; ``where`` starts the message."""
    if ":" in name:
        if not is_dotted_path(name):
            raise ConfigError(f"{where}{name!r} is not a well-formed 'pkg.module:callable'")
    elif name not in REWARD_ARGS:
        raise ConfigError(f"{where}unknown reward {name!r}{did_you_mean(name, REWARD_ARGS)} (known: "
                          f"{', '.join(REWARD_ARGS)}; or 'pkg.module:callable')")


def check_reward_kwargs(name: str, kwargs: Mapping, where: str) -> None:
    """A built-in reward's arguments: ConfigError naming the first unknown one (``where`` + its name), then the
    values its constructor would refuse only once the engines run (``ARG_VALUE_CHECKS``)."""
    known = REWARD_ARGS[name]
    for arg in kwargs:
        if arg not in known:
            listed = f"its arguments: {', '.join(known)}" if known else "it takes no arguments"
            raise ConfigError(f"{where}{arg}: reward {name!r} has no argument {arg!r}{did_you_mean(arg, known)} "
                              f"({listed})")
    for arg, check in ARG_VALUE_CHECKS.get(name, {}).items():
        if kwargs.get(arg) is not None:
            try:
                check(kwargs[arg])
            except ValueError as e:
                raise ConfigError(f"{where}{arg}: {e}") from None


# built-in reward -> {argument: check(value) raising ValueError}: told without torch, before any engine starts
ARG_VALUE_CHECKS: dict[str, dict[str, Callable[[object], object]]] = {"color_target": {"target": parse_color}}


def check_custom_reward(name: str, kwargs: Mapping, where: str) -> object:
    """The callable ``'pkg.mod:fn'`` names, its module imported now (a user's module may import torch: this is the
    run's own import, done early), with ``kwargs`` bound to its signature: a function is called as
    ``fn(images, prompts, metadata, **kwargs)``, a class is built as ``cls(**kwargs)``."""
    try:
        target = resolve(name, "reward")
    except ValueError as e:
        raise ConfigError(f"{where}{e}") from None
    if not callable(target):
        raise ConfigError(f"{where}reward {name!r} is {type(target).__name__}, not a function or class")
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):  # no signature to read (a builtin): its call decides
        return target
    try:
        sig.bind(**kwargs) if inspect.isclass(target) else sig.bind(None, None, None, **kwargs)
    except TypeError as e:
        params = [p for p, v in sig.parameters.items() if v.kind in (v.POSITIONAL_OR_KEYWORD, v.KEYWORD_ONLY)]
        stray = [a for a in kwargs if a not in params]
        hint = did_you_mean(stray[0], params) if stray else ""
        call = "cls(**kwargs)" if inspect.isclass(target) else "fn(images, prompts, metadata, **kwargs)"
        raise ConfigError(f"{where}reward {name!r} cannot be called as {call} with {dict(kwargs)}: {e}{hint}") from None
    return target
