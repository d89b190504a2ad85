"""``megaflow.config.dotted``: a config's 'pkg.mod:fn' module is found on the Python path without being imported.
Needs: CPU, 1 process (< 1 s)."""
from __future__ import annotations

import sys

from megaflow.config.dotted import module_findable, unfindable


def test_finds_modules_and_submodules_without_importing_them(tmp_path, monkeypatch):
    pkg = tmp_path / "userpkg_q"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (pkg / "rewards.py").write_text("raise RuntimeError('imported')\n")
    (tmp_path / "flat_q.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert module_findable("userpkg_q") and module_findable("userpkg_q.rewards") and module_findable("flat_q")
    assert not module_findable("userpkg_q.nothing") and not module_findable("flat_q.sub")
    assert not module_findable("no_such_top_q")
    assert not any(m in sys.modules for m in ("userpkg_q", "userpkg_q.rewards", "flat_q"))


def test_imported_builtin_and_stdlib_modules_are_found():
    assert module_findable("megaflow.models.sd3.spec") and module_findable("sys") and module_findable("json.decoder")
    assert unfindable("megaflow.models.sd3.spec:get_mmdit_layer_spec") is None
    assert unfindable("megaflow.nope_q:f") == "megaflow.nope_q"
