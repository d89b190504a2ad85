"""The rewards a config (``reward.weights``, ``reward.kwargs``) or ``megaflow eval reward`` names, checked before
anything starts: a built-in reward's name and its argument names (standard library only: ``REWARD_ARGS`` mirrors
the constructors in megaflow.rewards.registry, which import torch; tests/config/test_reward_check.py keeps them
equal), and a custom ``'pkg.mod:fn'`` reward resolved in full: its module imported, the callable found, the
arguments bound to its signature. Every mistake is one ConfigError line, with a did-you-mean where one is close.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping

from megaflow.config.dotted import is_dotted_path, resolve
from megaflow.config.load import ConfigError
from megaflow.config.suggest import did_you_mean

_REMOTE = ("timeout", "retries", "backoff", "jpeg_quality")
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
                  "concurrency", "api_key_env"),
    "clipscore": ("path", "device", "batch_size", "w", "prefix"),
    "pickscore": ("path", "processor_path", "device", "batch_size", "scale"),
    "aesthetic": ("clip_path", "head_path", "device", "batch_size"),
    "imagereward": ("path", "tokenizer_path", "device", "batch_size"),
    "hpsv2": ("path", "tokenizer_path", "device", "batch_size"),
}


def check_reward_name(name: str, where: str) -> None:
    """A built-in reward name or a well-formed ``'pkg.module:callable'``; ``where`` starts the message."""
    if ":" in name:
        if not is_dotted_path(name):
            raise ConfigError(f"{where}{name!r} is not a well-formed 'pkg.module:callable'")
    elif name not in REWARD_ARGS:
        raise ConfigError(f"{where}unknown reward {name!r}{did_you_mean(name, REWARD_ARGS)} (known: "
                          f"{', '.join(REWARD_ARGS)}; or 'pkg.module:callable')")


def check_reward_kwargs(name: str, kwargs: Mapping, where: str) -> None:
    """A built-in reward's argument names: ConfigError naming the first unknown one (``where`` + its name)."""
    known = REWARD_ARGS[name]
    for arg in kwargs:
        if arg not in known:
            listed = f"its arguments: {', '.join(known)}" if known else "it takes no arguments"
            raise ConfigError(f"{where}{arg}: reward {name!r} has no argument {arg!r}{did_you_mean(arg, known)} "
                              f"({listed})")


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
