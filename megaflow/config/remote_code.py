"""Whether a model directory holds code that a loader would run: the one home of that question, asked by the
preflight and, as a guard, by every megaflow loader of a model directory (standard library only).

Invariant: a model directory is data; the code in it (a config's ``auto_map``, a custom pipeline or component
class read from a ``.py`` beside it) runs only where the user passed ``--trust-remote-code``.
"""
from __future__ import annotations

import json
from pathlib import Path

from megaflow.config.load import ConfigError

KNOWN_LIBRARIES = ("diffusers", "transformers")
"""The libraries a component of ``model_index.json`` may name; any other is a module diffusers imports (from a
``.py`` in the component's folder when there is one)."""
CONFIG_FILES = ("config.json", "tokenizer_config.json", "preprocessor_config.json", "processor_config.json")
"""The files of a model folder whose ``auto_map`` makes transformers' / diffusers' Auto classes import a module."""
TRUST_HINT = "code in a model directory runs only with --trust-remote-code"


def _json(path: Path) -> dict | None:
    """The JSON object in ``path``; None when absent or unreadable (the file checks name those)."""
    try:
        obj = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def _auto_map(folder: Path) -> tuple[Path, str] | None:
    for name in CONFIG_FILES:
        conf = _json(folder / name)
        if conf is not None and conf.get("auto_map"):
            return folder / name, f"auto_map {json.dumps(conf['auto_map'])[:120]} names code to import"
    return None


def custom_components(path: str | Path) -> list[tuple[str, Path, str]]:
    """(component, the file that names or holds its class, what it is) for every custom class of the pipeline
    ``path``'s model_index.json: a ``_class_name`` list (a custom pipeline) or a component whose library is not
    one of ``KNOWN_LIBRARIES``."""
    path = Path(path)
    index = _json(path / "model_index.json")
    if index is None:
        return []
    found = []
    pipeline = index.get("_class_name")
    if isinstance(pipeline, list):
        module = f"{pipeline[0]}.py" if pipeline and isinstance(pipeline[0], str) else "a module"
        found.append(("_class_name", path / "model_index.json", f"custom pipeline class {pipeline} (from {module})"))
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or len(spec) != 2 or spec[0] is None:
            continue
        library = spec[0]
        if library in KNOWN_LIBRARIES:
            continue
        module = path / name / f"{library}.py" if isinstance(library, str) else None
        where = module if module is not None and module.is_file() else path / "model_index.json"
        found.append((name, where, f"custom component class {spec} for {name!r} (not from "
                                   f"{' or '.join(KNOWN_LIBRARIES)})"))
    return found


def find_remote_code(path: str | Path) -> tuple[Path, str] | None:
    """(file, why) of the first file of the model directory ``path`` (a diffusers pipeline with model_index.json,
    or one model's folder) that makes a loader import code from it; None when there is none."""
    path = Path(path)
    custom = custom_components(path)
    if custom:
        return custom[0][1], custom[0][2]
    folders = [path]
    index = _json(path / "model_index.json")
    if index is not None:
        folders += [path / name for name, spec in index.items() if not name.startswith("_")
                    and isinstance(spec, list) and (path / name).is_dir()]
    for folder in folders:
        found = _auto_map(folder)
        if found:
            return found
    return None


def refuse_custom_components(path: str | Path, key: str) -> None:
    """ConfigError (one line naming the component) when the pipeline ``path`` has a custom class, for the SGLang
    engine: its native pipelines load diffusers and transformers classes only, trusted or not."""
    custom = custom_components(path)
    if custom:
        name, where, what = custom[0]
        raise ConfigError(f"{key}: {where}: {what}: the SGLang engine cannot load it (its native pipelines load "
                          f"{' and '.join(KNOWN_LIBRARIES)} classes only)")


def refuse_remote_code(path: str | Path, key: str, *, trust: bool = False) -> None:
    """ConfigError (``key: file: why: ...``, one line) when the model directory ``path`` holds code a loader would
    run and ``trust`` (the user's --trust-remote-code) is not given."""
    if trust:
        return
    found = find_remote_code(path)
    if found is not None:
        raise ConfigError(f"{key}: {found[0]}: {found[1]}; {TRUST_HINT}")
