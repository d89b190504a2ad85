"""``'pkg.mod:fn'`` paths a config names: checked before the run imports them (syntax, module findable, not run),
and resolved (``resolve``, with a did-you-mean for a missing attribute) when needed.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import re
import sys

from megaflow.config.suggest import did_you_mean

_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def is_dotted_path(text: str) -> bool:
    """``'pkg.mod:fn'`` (attribute may be dotted): the syntax only, nothing is imported."""
    return bool(_DOTTED.match(text))


def module_findable(module: str) -> bool:
    """Whether ``import module`` would find it (an already imported one, or one on ``sys.path``, package by
    package), without executing any of it."""
    parts, found = module.split("."), None
    for i in range(len(parts)):
        name = ".".join(parts[:i + 1])
        if name in sys.modules:
            found = sys.modules[name].__spec__
            continue
        locations = None if i == 0 else (found.submodule_search_locations if found else None)
        if i > 0 and not locations:
            return False
        found = importlib.machinery.PathFinder.find_spec(name, locations)
        if found is None and i == 0:
            found = importlib.machinery.BuiltinImporter.find_spec(name) or importlib.machinery.FrozenImporter.find_spec(name)
        if found is None:
            return False
    return True


def unfindable(path: str) -> str | None:
    """The module of ``'pkg.mod:fn'`` when it cannot be found (``module_findable``), else None."""
    module = path.partition(":")[0]
    return None if module_findable(module) else module


def resolve(path: str, what: str) -> object:
    """The object ``'pkg.mod:attr'`` names (``attr`` may be dotted), imported now; ValueError naming ``what`` (e.g.
    "reward", "model.spec") and ``path`` when the syntax is wrong, the module does not import or an attribute is
    missing."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"bad {what} path {path!r}: expected 'pkg.module:attr'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r} ({e})") from None
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - the user's module raised (SystemExit too) while it was imported
        raise ValueError(f"{what} {path!r}: importing module {module_name!r} raised {type(e).__name__}: "
                         f"{' '.join(str(e).split())}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            hint = did_you_mean(part, [n for n in dir(obj) if not n.startswith("_")])
            raise ValueError(f"{what} {path!r}: {module_name!r} has no attribute {attr!r}{hint}")
        obj = getattr(obj, part)
    return obj
