"""Did-you-mean hints for mistyped names (config keys, rewards, arguments, dotted attributes), via difflib:
each returns `` (did you mean 'x'?)`` or ``""``; the error is raised either way. Invariant: the work is bounded
(difflib is quadratic in the word): a word longer than ``MAX_WORD`` characters gets no hint, and ``clipped``
shortens what a message shows of it.
"""
from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable

CUTOFF = 0.6  # difflib's similarity ratio a suggestion needs (its own default)
MAX_WORD = 100  # a longer name is no typo of a config key, reward or argument: no hint is searched for
MAX_SHOWN = 80  # characters of a name or value a one-line message shows


def clipped(text: object) -> str:
    """``text`` (a name, or a value's repr) as a message shows it: whole up to ``MAX_SHOWN`` characters, else its
    start and its length."""
    text = str(text)
    return text if len(text) <= MAX_SHOWN else f"{text[:MAX_SHOWN]}... ({len(text)} characters)"


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice closest to ``word`` (difflib, ratio >= ``CUTOFF``), or None (always for a word over
    ``MAX_WORD`` characters)."""
    if len(word) > MAX_WORD:
        return None
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=CUTOFF)
    return match[0] if match else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the choice closest to ``word``, else ``""``."""
    match = closest(word, choices)
    return f" (did you mean {match!r}?)" if match else ""


def suggest_key(cfg, section: str, key: str) -> str:
    """The hint for an unknown ``section.key`` of ``cfg``: a close key of the section, a key it prefixes, the same key
    in another section, a key whose help holds its words, else a close key elsewhere; none for a key over
    ``MAX_WORD`` characters."""
    if len(key) > MAX_WORD:
        return ""
    sections = {f.name: {g.name: g for g in dataclasses.fields(getattr(cfg, f.name))} for f in dataclasses.fields(cfg)}
    own = sections.get(section, {})
    words = key.replace("_", " ").replace("-", " ").lower().strip()
    others = {f"{s}.{k}": k for s, fields in sections.items() if s != section for k in fields}
    candidates = (
        lambda: [f"{section}.{k}" for k in [closest(key, own)] if k],
        lambda: [f"{section}.{k}" for k in own if len(key) >= 3 and k.startswith(key)],
        lambda: [d for d, k in others.items() if k == key],
        lambda: sorted((f"{section}.{k}" for k, f in own.items() if words and words in _help(f)),
                       key=lambda d: len(_help(own[d.split(".")[1]])))[:1],  # the field most about those words
        lambda: [d for d, k in others.items() if k == closest(key, set(others.values()))],
    )
    found = next((c for c in (make() for make in candidates) if c), [])
    return f" (did you mean {' or '.join(found)}?)" if found else ""


def _help(f: dataclasses.Field) -> str:
    return str(f.metadata.get("help", "")).lower()


def suggest_section(cfg, section: str) -> str:
    """The hint for an unknown config section of ``cfg``."""
    return did_you_mean(section, [f.name for f in dataclasses.fields(cfg)])
