"""What every GPU check shares: the Skip signal, requirement probes, error summaries (standard library only at
import time: the driver imports this without torch)."""
from __future__ import annotations

import importlib
import importlib.util
import re
import traceback


class Skip(Exception):
    """Raised by a check that cannot run here; its message is the reason."""


def last_line(text: str) -> str:
    """The last non-empty line of ``text`` (an error's summary), at most 500 characters."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:500]


def error_summary(text: str) -> str:
    """The last line of ``text`` that names an error (``...Error: ...``, ``...Exception: ...``, or megaflow's
    ``error: ...`` line), else its last line: a warning printed at exit does not hide the error before it."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    named = [ln for ln in lines if re.match(r"^([\w.]*(Error|Exception)\b|error:|megaflow:[\w ]*error)", ln)]
    return ((named or lines or [""])[-1])[:500]


def error_line(exc: BaseException) -> str:
    """``Type: message`` of an exception, its last line only."""
    return last_line("".join(traceback.format_exception_only(type(exc), exc)))


def probe_import(name: str, *, really: bool) -> dict:
    """{"ok": bool, "version" | "error": ...} for module ``name``: imported when ``really``, else only looked up
    (``find_spec``: no import cost; used where no CUDA device makes the import moot)."""
    if not really:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError) as e:
            return {"ok": False, "error": error_line(e)}
        return {"ok": found, "mode": "find_spec"} if found else {"ok": False, "error": "not installed"}
    try:
        mod = importlib.import_module(name)
    except BaseException as e:  # noqa: BLE001 - an import may fail in any way (OSError of a CUDA library, ...)
        return {"ok": False, "error": error_line(e)}
    top = importlib.import_module(name.split(".")[0])
    return {"ok": True, "version": str(getattr(mod, "__version__", getattr(top, "__version__", "?")))}


def require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise Skip("no CUDA device (torch.cuda.is_available() is False)")


def require_module(name: str) -> None:
    found = probe_import(name, really=True)
    if not found["ok"]:
        raise Skip(f"{name} does not import: {found['error']}")


def rel_err(got, ref) -> tuple[float, float]:
    """(max |got - ref|, that / max |ref|) in fp32."""
    err = float((got.float() - ref.float()).abs().max())
    return err, err / max(float(ref.float().abs().max()), 1e-30)
