"""The house rules of megaflow's layout, read from the source with ``ast`` (nothing is imported):

- a room is the first package under ``megaflow/`` (``megaflow/run/...`` is the room ``run``); a loose module at
  the top is a room of its own;
- no import cycle between rooms (imports inside functions count too), and no room imports one listed above it
  in ``docs/architecture.md``'s rooms table (top down), which lists every room;
- every module path ``docs/architecture.md`` names exists, and every ``docs/`` page a module docstring names;
- at most 4 loose modules at the top of ``megaflow/``;
- no file over 400 lines;
- every directory of modules is a package (an ``__init__.py``: what setuptools installs);
- no module outside ``models/`` and ``families/`` tests a model family's name (``family == "sd3"``,
  ``d.family in ("sd3", "flux")``) or keys a table by one: what differs by family is its card or its ``FAMILY``;
- no algorithm's module imports another algorithm's. An algorithm X owns ``algo/X.py`` (math), ``trainer/X.py``
  (update) and ``run/X.py`` (requests, settings, shadows), plus any ``<room>/X_*.py``; what algorithms share lives
  in the shared modules below (``ALGORITHM_SHARED``).

Needs: CPU, 1 process, no torch (< 1 s)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megaflow"
MAX_LOOSE_MODULES = 4
MAX_LINES = 400
ALGORITHMS = ("flowgrpo", "nft", "awm", "dgpo")
ALGORITHM_ROOMS = ("algo", "trainer", "run")
ALGORITHM_SHARED = ("megaflow.algo.advantages", "megaflow.algo.masked", "megaflow.run.requests", "megaflow.trainer.batch")


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


def algorithm_of(module: str) -> str | None:
    """The algorithm owning a ``megaflow.*`` module name: ``megaflow.<room>.X`` or ``megaflow.<room>.X_*`` for an
    algorithm X in one of ALGORITHM_ROOMS (a name imported from it, ``megaflow.<room>.X.f``, counts as X's too)."""
    parts = module.split(".")
    if len(parts) < 3 or parts[0] != "megaflow" or parts[1] not in ALGORITHM_ROOMS:
        return None
    return next((a for a in ALGORITHMS if parts[2] == a or parts[2].startswith(f"{a}_")), None)


def algorithm_modules() -> dict[str, Path]:
    return {name: path for path in sorted(PACKAGE.rglob("*.py"))
            if algorithm_of(name := module_name(path)) is not None}


def test_algorithm_modules_are_known():
    found = {algorithm_of(m) for m in algorithm_modules()}
    assert found == set(ALGORITHMS), found  # every algorithm has its modules (a renamed file fails here)
    math = {module_name(p) for p in (PACKAGE / "algo").glob("*.py") if p.name != "__init__.py"}
    unowned = sorted(m for m in math if algorithm_of(m) is None and m not in ALGORITHM_SHARED)
    assert not unowned, f"algo/ modules that are neither an algorithm's nor shared: {unowned}"
    registry = {m.split(".")[2] for m in imported_modules(PACKAGE / "run" / "algorithm.py")
                if m.startswith("megaflow.run.") and len(m.split(".")) == 3}
    assert registry <= set(ALGORITHMS) | {"requests"}, registry  # build_algorithm's classes are known algorithms


def test_no_algorithm_imports_another():
    crossing = {}
    for name, path in algorithm_modules().items():
        own = algorithm_of(name)
        others = sorted(m for m in imported_modules(path) if algorithm_of(m) not in (None, own))
        if others:
            crossing[name] = others
    assert not crossing, f"an algorithm imports another's modules (move what they share to {ALGORITHM_SHARED}): " \
                         f"{crossing}"


def test_shared_modules_import_no_algorithm():
    for name in ALGORITHM_SHARED:
        path = PACKAGE.parent / (name.replace(".", "/") + ".py")
        used = sorted(m for m in imported_modules(path) if algorithm_of(m) is not None)
        assert not used, f"{name} is shared by every algorithm but imports {used}"


def test_algorithm_imports_are_read():
    assert algorithm_of("megaflow.trainer.flowgrpo_batches.dp_slice") == "flowgrpo"
    assert algorithm_of("megaflow.run.nft") == "nft" and algorithm_of("megaflow.run.loop") is None
    nft = imported_modules(PACKAGE / "trainer" / "nft.py")
    assert "megaflow.algo.nft" in nft and "megaflow.trainer.batch" in nft, sorted(nft)


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
REPO_DIRS = ("megaflow", "tests", "configs", "docs", "tools", "scripts", "assets")


def architecture_paths() -> list[tuple[str, str | None]]:
    """Every module or package path ``docs/architecture.md`` names in backticks, with the room of the table row
    it stands in (a bare ``x.py`` in a room's row is that room's)."""
    found = []
    for line in ARCHITECTURE.read_text().splitlines():
        row = re.match(r"\| `([a-z_]+)(?:/|\.py)` \|", line)
        for token in re.findall(r"`([^`\s]+)`", line):
            path = token.split(" ")[0]
            if re.fullmatch(r"[\w./]+\.py|\w+(?:/\w+)*/", path) or re.fullmatch(r"\w+/[\w/]*\w\.\w+", path):
                found.append((path, row.group(1) if row else None))
    return found


def architecture_path_exists(path: str, room: str | None) -> bool:
    """``path`` as the page names it: a repository file, a package path (``room/module.py``), or a bare module
    name, which in a room's row must be that room's (at any depth) and elsewhere anywhere in the package."""
    root, pkg = PACKAGE.parent, PACKAGE
    if path.split("/")[0] in REPO_DIRS and (root / path).exists():  # a file of the repository, as named
        return True
    if not path.endswith((".py", "/")):  # room/module.name: the module's file
        path = path.rsplit(".", 1)[0] + ".py"
    if path.split("/")[0] in REPO_DIRS:
        return (root / path).exists()
    if "/" in path.rstrip("/") or path.rstrip("/").removesuffix(".py") == room:  # a package path, or the room
        return (pkg / path).exists()
    if room is not None:
        return any((pkg / room).rglob(path.rstrip("/")))
    return (pkg / path).exists() or any(pkg.rglob(path.rstrip("/")))


def architecture_rooms() -> list[str]:
    """The rooms of the page's rooms table, top down."""
    return re.findall(r"^\| `([a-z_]+)(?:/|\.py)` \|", ARCHITECTURE.read_text(), re.M)


def test_rooms_import_only_rooms_below_them_in_the_architecture_page():
    graph, order = room_graph(), architecture_rooms()
    assert set(graph) <= set(order), f"rooms missing from docs/architecture.md's table: {sorted(set(graph) - set(order))}"
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if order.index(b) < order.index(a))
    assert not upward, f"rooms import rooms listed above them in docs/architecture.md: {upward}"
    # run/ by job: the user commands drive the loop core, which writes through the run's bookkeeping (never back up)
    assert order.index("cli") < order.index("commands") < order.index("run") < order.index("rundir"), order
    assert {"run", "rundir"} <= graph["commands"] and "rundir" in graph["run"], (graph["commands"], graph["run"])


def test_every_module_the_architecture_page_names_exists():
    paths = architecture_paths()
    assert len(paths) > 50 and ("loop.py", "run") in paths, paths[:10]  # the page was read
    missing = sorted({f"{room + '/' if room else ''}{path}" for path, room in paths
                      if not architecture_path_exists(path, room)})
    assert not missing, f"docs/architecture.md names modules that do not exist (where it says): {missing}"


def test_a_module_named_in_the_wrong_room_is_missing():
    assert architecture_path_exists("hosted.py", "rollout") and architecture_path_exists("server.py", "rollout")
    assert not architecture_path_exists("hosted.py", "bridge")  # rollout's, not bridge's
    assert not architecture_path_exists("colocated.py", "bridge") and not architecture_path_exists("nosuch.py", None)
    assert architecture_path_exists("checksum.py", "checksum") and architecture_path_exists("bridge/", "bridge")


def test_every_docs_page_a_module_docstring_names_exists():
    named = {}
    for path in PACKAGE.rglob("*.py"):
        doc = ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""
        for page in re.findall(r"\bdocs/[\w/.-]*\w\.md", doc):
            named.setdefault(page, str(path.relative_to(PACKAGE.parent)))
    assert "docs/algorithms/flowgrpo.md" in named, sorted(named)  # the docstrings were read
    missing = {page: module for page, module in named.items() if not (PACKAGE.parent / page).is_file()}
    assert not missing, f"module docstrings name docs pages that do not exist: {missing}"


FAMILY_HOMES = ("megaflow/models/", "megaflow/families/")


def family_names_on_disk() -> set[str]:
    """The registered families' names: one card module per family in ``megaflow/families/``."""
    return {p.stem for p in (PACKAGE / "families").glob("*.py")} - {"__init__", "card"}


def _names_family(node: ast.AST) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "family" in name.lower()


def _literal_strings(node: ast.AST) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_literal_strings(e) for e in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def family_tests(source: str, names: set[str]) -> list[str]:
    """``line: code`` of each family test in ``source``: a comparison of something named ``*family*`` with string
    literals, and a dict literal keyed by a family's name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        operands = [node.left, *node.comparators] if isinstance(node, ast.Compare) else []
        if any(map(_names_family, operands)) and any(map(_literal_strings, operands)):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value in names for k in node.keys):
            found.append(f"{node.lineno}: a table keyed by family names {ast.unparse(node)[:60]}")
    return found


def test_no_family_test_outside_the_family_folders():
    names, root = family_names_on_disk(), PACKAGE.parent
    assert {"sd3", "flux"} <= names, names  # the cards were found
    found = {}
    for path in sorted([*PACKAGE.rglob("*.py"), *(root / "tools").rglob("*.py")]):
        rel = str(path.relative_to(root))
        if not rel.startswith(FAMILY_HOMES) and (hits := family_tests(path.read_text(), names)):
            found[rel] = hits
    assert not found, f"model-family tests outside {FAMILY_HOMES} (use the family's card or FAMILY): {found}"


def test_family_tests_are_detected():
    names = {"sd3", "flux"}
    caught = ('x = 2 if cfg.model.family == "flux" else 1', 'if family in ("sd3",): pass',
              'ok = self.family != "sd3"', 'T = {"sd3": 3, "flux": 2}')
    assert all(family_tests(code, names) for code in caught), [family_tests(c, names) for c in caught]
    allowed = ("if family != cfg.model.family: pass", 'get_family("sd3")', 'if name not in family_names(): pass',
               'T = {"sd4": 1}', 'if mode == "flux": pass')
    assert not any(family_tests(code, names) for code in allowed), [family_tests(c, names) for c in allowed]
