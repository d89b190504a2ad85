"""Every config field is read by the code it configures: a schema field that nothing reads is a defect
(its help text promises something no code does). Needs: CPU, 1 process (parses source files only).

A field ``section.name`` counts as read only where the code reads it THROUGH ITS SECTION:
- ``<cfg>.section.name``, where ``<cfg>`` is a name or attribute spelled with "cfg" or "config"
  (``cfg.algo.kl_beta``, ``self.cfg.eval.num``);
- ``x.name`` where ``x`` was bound to the section in the same function (``a = cfg.algo``,
  ``r, a = cfg.rollout, cfg.algo``), or is the parameter a section was passed to in a call of a function
  defined in megaflow/ or tools/ (``plain_optimizer(dit, cfg.train)`` -> ``train.lr``);
- the generic builder ``from_section(Cls, section, **given)`` (megaflow.config.sections): every field of
  ``Cls`` (its annotated class attributes, found by class name in the same sources) that the section also
  has, minus the names in ``given``.
The loader (config/load.py: validation, dump) and the schema itself do not count.
"""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from megaflow.config.schema import MegaflowConfig

REPO = Path(__file__).resolve().parents[2]
SKIP = {REPO / "megaflow" / "config" / "schema.py", REPO / "megaflow" / "config" / "load.py"}
SECTIONS = {f.name: {g.name for g in dataclasses.fields(getattr(MegaflowConfig(), f.name))}
            for f in dataclasses.fields(MegaflowConfig)}


def _sources() -> dict[Path, ast.Module]:
    files = [*(REPO / "megaflow").rglob("*.py"), *(REPO / "tools").rglob("*.py")]
    return {p: ast.parse(p.read_text(), str(p)) for p in sorted(files) if p not in SKIP}


def _leaf(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def _section_of(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """The section ``node`` evaluates to: ``<cfg>.section`` or a name bound to one."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute) and node.attr in SECTIONS:
        base = _leaf(node.value).lower()
        if "cfg" in base or "config" in base:
            return node.attr
    return None


def _scopes(tree: ast.Module):
    """(scope node, its parameter names) for the module and every function in it."""
    yield tree, []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            yield node, [x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]]


def _local_aliases(scope: ast.AST, aliases: dict[str, str]) -> dict[str, str]:
    aliases = dict(aliases)
    for node in ast.walk(scope):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = [(target, node.value)]
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs = list(zip(target.elts, node.value.elts))
            for t, v in pairs:
                section = _section_of(v, aliases)
                if isinstance(t, ast.Name) and section:
                    aliases[t.id] = section
    return aliases


def _class_fields(trees) -> dict[str, set[str]]:
    out = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                out[node.name] = {s.target.id for s in node.body
                                  if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    return out


def read_fields(trees: list[ast.Module] | None = None) -> set[str]:
    trees = list(_sources().values()) if trees is None else trees
    functions = {}
    for tree in trees:
        for node, params in _scopes(tree):
            if node is not tree:
                functions.setdefault(node.name, []).append(params)
    classes = _class_fields(trees)
    param_aliases: dict[tuple[str, str], str] = {}  # (function name, parameter) -> section
    read: set[str] = set()
    for _ in range(3):  # sections passed on through calls: iterate to a fixed point
        for tree in trees:
            for scope, params in _scopes(tree):
                name = getattr(scope, "name", None)
                aliases = _local_aliases(scope, {p: param_aliases[name, p] for p in params
                                                 if (name, p) in param_aliases})
                for node in ast.walk(scope):
                    if isinstance(node, ast.Attribute):
                        section = _section_of(node.value, aliases)
                        if section and node.attr in SECTIONS[section]:
                            read.add(f"{section}.{node.attr}")
                    if not isinstance(node, ast.Call):
                        continue
                    callee = _leaf(node.func)
                    if callee == "from_section" and len(node.args) >= 2:
                        section = _section_of(node.args[1], aliases)
                        given = {k.arg for k in node.keywords}
                        if section:
                            shared = classes.get(_leaf(node.args[0]), set()) & SECTIONS[section]
                            read |= {f"{section}.{f}" for f in shared - given}
                    for plist in functions.get(callee, []):
                        offset = 1 if plist[:1] == ["self"] and isinstance(node.func, ast.Attribute) else 0
                        for i, arg in enumerate(node.args):
                            section = _section_of(arg, aliases)
                            if section and i + offset < len(plist):
                                param_aliases[callee, plist[i + offset]] = section
                        for kw in node.keywords:
                            section = _section_of(kw.value, aliases)
                            if section and kw.arg in plist:
                                param_aliases[callee, kw.arg] = section
    return read


def test_every_schema_field_is_read_through_its_section():
    read = read_fields()
    unread = sorted(f"{s}.{f}" for s, fields in SECTIONS.items() for f in fields if f"{s}.{f}" not in read)
    assert not unread, f"config fields read by nothing (through their section): {unread}"


def test_the_rule_can_fail():
    """A bare ``.timestep_fraction`` on something that is not the algo section does not count; aliases,
    parameters and the builder do; a name given explicitly to the builder is not counted as read by it."""
    code = ("def f(cfg, other):\n"
            "    other.timestep_fraction\n"
            "    a = cfg.algo\n"
            "    a.adv_clip\n"
            "    from_section(LossConfig, a, clip_range=1.0)\n"
            "    helper(cfg.train)\n"
            "def helper(t):\n"
            "    t.lr\n"
            "class LossConfig:\n"
            "    clip_range: float\n"
            "    kl_beta: float\n")
    assert read_fields([ast.parse(code)]) == {"algo.adv_clip", "algo.kl_beta", "train.lr"}
