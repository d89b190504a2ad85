"""Reading back a ``megaflow bench learn`` report (``--algos ... --reuse``): the file and every field the
leaderboard reads from it are checked first, so a damaged, hand-edited or hostile report is ONE ValueError line
naming the file and the field, never a traceback mid-table. Invariant: the file is read only when it is a regular
file of at most ``MAX_REPORT_BYTES`` (a FIFO or ``/dev/zero`` in its place is refused unread), its JSON nests at
most ``MAX_DEPTH`` deep, and each check is linear in the report's size.
"""
from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

MAX_REPORT_BYTES = 64 << 20  # a report is a few hundred KB (its curves)
MAX_DEPTH = 32  # lists / objects inside a report (it nests 5 deep)


def read_report(path: Path, where: str) -> dict:
    """The JSON object of the report ``path``; ValueError ``"<where>: <path> ..."`` when it is missing, no regular
    file, too large, not UTF-8 JSON, nested too deep or not an object."""
    try:
        info = os.stat(path)
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise ValueError(f"{where}: {path}: no bench learn report to reuse ({why})") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{where}: {path} is not a regular file (a bench learn report is a JSON file)")
    if info.st_size > MAX_REPORT_BYTES:
        raise ValueError(f"{where}: {path} is {info.st_size} bytes, more than the {MAX_REPORT_BYTES >> 20} MiB a "
                         "bench learn report may be")
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_REPORT_BYTES + 1)
        report = json.loads(data.decode("utf-8"))
    except OSError as e:
        raise ValueError(f"{where}: {path}: {e.strerror or type(e).__name__}") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{where}: {path} is not a bench learn report (not JSON: {str(e)[:80]})") from None
    except RecursionError:
        raise ValueError(f"{where}: {path} is not a bench learn report (nested too deeply to read)") from None
    _check_depth(report, path, where)
    if not isinstance(report, dict):
        raise ValueError(f"{where}: {path} is not a bench learn report (a JSON {type(report).__name__}, not an "
                         "object)")
    return report


def _check_depth(value, path: Path, where: str) -> None:
    """ValueError when ``value`` nests more than ``MAX_DEPTH`` lists / objects deep (an iterative walk)."""
    todo = [(value, 0)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, (dict, list)):
            if depth >= MAX_DEPTH:
                raise ValueError(f"{where}: {path} nests more than {MAX_DEPTH} lists or objects deep (not a bench "
                                 "learn report)")
            todo.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))


def _field(value, name: str, want: str, path: Path, where: str):
    """``value`` when it is ``want`` (``table``, ``list``, ``number``: finite, not a bool; ``number|null``,
    ``table|null``); ValueError naming the report, the field and what it holds."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = {"table": isinstance(value, dict), "list": isinstance(value, list), "number": number,
          "number|null": value is None or number, "table|null": value is None or isinstance(value, dict)}[want]
    if not ok:
        shown = repr(value) if len(repr(value)) <= 60 else f"a {type(value).__name__}"
        raise ValueError(f"{where}: {path}: {name} is {shown}, want a {want.replace('table', 'JSON object')} "
                         "(not a bench learn report this version reads; run it again)")
    return value


def checked_side(report: dict, side: str, path: Path, where: str) -> dict:
    """``report["sides"][side]`` with every field the leaderboard reads checked (``_field``): before / after
    (accuracy, ci95 [lo, hi], seen_accuracy, per_category), curve ([{rl_s, accuracy}, ...]), rl_wall_s and
    peak_rss_mib; the top-level ``recipe`` and ``eval`` objects too (absent: an older report)."""
    def need(value, name, want):
        return _field(value, name, want, path, where)

    def get(table: dict, key: str, name: str, want: str):
        if key not in table and not want.endswith("null"):
            raise ValueError(f"{where}: {path}: {name} is missing (not a bench learn report; run it again)")
        return need(table.get(key), name, want)

    for part in ("recipe", "eval"):
        need(report.get(part, {}), part, "table")
    sides = get(report, "sides", "sides", "table")
    one = get(sides, side, f"sides.{side}", "table")
    prefix = f"sides.{side}"
    for when in ("before", "after"):
        ev = get(one, when, f"{prefix}.{when}", "table")
        get(ev, "accuracy", f"{prefix}.{when}.accuracy", "number")
        ci = get(ev, "ci95", f"{prefix}.{when}.ci95", "list")
        if len(ci) != 2:
            raise ValueError(f"{where}: {path}: {prefix}.{when}.ci95 has {len(ci)} entries, want [low, high]")
        for i, bound in enumerate(ci):
            need(bound, f"{prefix}.{when}.ci95[{i}]", "number")
        get(ev, "seen_accuracy", f"{prefix}.{when}.seen_accuracy", "number|null")
        get(ev, "per_category", f"{prefix}.{when}.per_category", "table")
    for i, point in enumerate(get(one, "curve", f"{prefix}.curve", "list")):
        need(point, f"{prefix}.curve[{i}]", "table")
        for key in ("rl_s", "accuracy"):
            get(point, key, f"{prefix}.curve[{i}].{key}", "number")
    get(one, "rl_wall_s", f"{prefix}.rl_wall_s", "number")
    for name, value in (get(one, "peak_rss_mib", f"{prefix}.peak_rss_mib", "table|null") or {}).items():
        need(value, f"{prefix}.peak_rss_mib.{name}", "number")
    return one
