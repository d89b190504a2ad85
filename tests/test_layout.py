"""The house rules of megaflow's layout, read from the source with ``ast`` (nothing is imported):

- no import cycle between rooms, counting imports inside functions too. A room is the first package under
  ``megaflow/`` (``megaflow/run/...`` is the room ``run``); a loose module at the top is a room of its own;
- at most 4 loose modules at the top of ``megaflow/``;
- no file over 400 lines;
- every directory of modules is a package (an ``__init__.py``: what setuptools installs).

Needs: CPU, 1 process, no torch (< 1 s)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megaflow"
MAX_LOOSE_MODULES = 4
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports anywhere in its body (absolute names; relative imports resolved)."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return found


def room_of(module: str) -> str | None:
    """The room a ``megaflow.*`` module name belongs to (None: not megaflow's, or not a module of it)."""
    parts = module.split(".")
    if parts[0] != "megaflow" or len(parts) < 2:
        return None
    if (PACKAGE / parts[1]).is_dir() or (PACKAGE / f"{parts[1]}.py").is_file():
        return parts[1]
    return None


def room_graph() -> dict[str, set[str]]:
    """room -> the other rooms its modules import."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        room = room_of(module_name(path))
        if room is None:  # megaflow/__init__.py: the package's face
            continue
        targets = {room_of(m) for m in imported_modules(path)} - {None, room}
        graph.setdefault(room, set()).update(targets)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one room (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_rooms():
    graph = room_graph()
    assert {"run", "rollout", "trainer", "config"} <= set(graph), sorted(graph)  # the graph was read
    found = cycles(graph)
    ties = {room: sorted(graph[room] & set(c)) for c in found for room in c}
    assert not found, f"rooms import each other: {found}; within them: {ties}"


def test_cycles_are_detected():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_at_most_four_loose_modules():
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(loose) <= MAX_LOOSE_MODULES, loose


def test_no_file_over_400_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_every_directory_of_modules_is_a_package():
    missing = sorted(str(d.relative_to(PACKAGE.parent)) for d in {p.parent for p in PACKAGE.rglob("*.py")}
                     if not (d / "__init__.py").is_file())
    assert not missing, missing
