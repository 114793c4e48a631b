"""Dependencies point one way (README, "Where things are"): the client (`codegym_client`) at the
bottom, then the shared core (`codegym`), then the sandbox worker, the services and the command
line; above them what the tests and the benchmarks share (`codegym_testkit`), then the benchmarks,
which import no `tests` module. Every import statement of every module (function-level ones included) is read from its AST,
so a module that imports upwards fails here even when nothing runs that import. And no module
imports itself back, at any level: the import graph of the whole repository (type-only and
function-level imports included) has no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT

# What each folder may import of this repository besides itself; the standard library and
# third-party packages are not this test's business (tests/test_jail_package.py fences the jail's
# code, tests/test_client_install.py the client's requirements).
ALLOWED = {
    "clients/codegym_client": set(),
    "codegym": {"codegym_client"},
    "sandbox_worker": {"codegym", "codegym_client"},
    "services": {"codegym", "codegym_client"},
    # What an operator runs against the services (pipeline, evaluation, export, replay): above them,
    # below the command line that starts it.
    "codegym_jobs": {"codegym", "codegym_client", "sandbox_worker", "services"},
    "codegym_cli": {"codegym", "codegym_client", "sandbox_worker", "services", "codegym_jobs"},
    # What the tests and the benchmarks share (scripted models, trainers, servers): above the
    # command line, below both of its users.
    "codegym_testkit": {
        "codegym",
        "codegym_client",
        "sandbox_worker",
        "services",
        "codegym_jobs",
        "codegym_cli",
    },
    # The benchmarks: at the top with the tests, but never importing them (an arrow the import
    # graph does not draw, since a bench runs as a script).
    "bench": {
        "codegym",
        "codegym_client",
        "sandbox_worker",
        "services",
        "codegym_jobs",
        "codegym_cli",
        "codegym_testkit",
    },
}
PROJECT = {
    "codegym",
    "codegym_client",
    "sandbox_worker",
    "services",
    "codegym_jobs",
    "codegym_cli",
    "codegym_testkit",
    "tests",
    "bench",
}
# The services share the sandbox dispatcher; none imports another service.
SHARED_SERVICE_MODULES = {"services", "services.dispatcher", "services.fronting"}


def imported_modules(path: Path) -> list[tuple[str, int]]:
    """(module, line) of every absolute import of a file."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node.lineno))
    return found


def modules_of(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_imports_point_down(folder: str) -> None:
    own = Path(folder).name
    modules = modules_of(folder)
    assert modules, folder
    upward = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in modules
        for name, line in imported_modules(path)
        if (top := name.split(".")[0]) in PROJECT and top != own and top not in ALLOWED[folder]
    ]
    assert upward == [], f"{folder} may import only {sorted(ALLOWED[folder]) or 'itself'} of this repository"


def test_services_do_not_import_each_other() -> None:
    crossing = []
    for service in sorted(p for p in (ROOT / "services").iterdir() if (p / "__init__.py").exists()):
        for path in modules_of(f"services/{service.name}"):
            for name, line in imported_modules(path):
                parts = name.split(".")
                if parts[0] == "services" and name not in SHARED_SERVICE_MODULES and parts[1] != service.name:
                    crossing.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert crossing == []


def test_benches_import_no_test_module() -> None:
    """Said apart from the floors above: what a bench needs of the tests' helpers lives in
    codegym_testkit, which both import."""
    found = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for folder in ("bench", "codegym_testkit")
        for path in modules_of(folder)
        for name, line in imported_modules(path)
        if name.split(".")[0] == "tests"
    ]
    assert found == []


# -- cycles -----------------------------------------------------------------------------------------

# Where each top-level package's files are (the client's sits under clients/).
PACKAGE_ROOTS = {top: ROOT / ("clients" if top == "codegym_client" else "") / top for top in PROJECT}


def module_names(roots: dict[str, Path] = PACKAGE_ROOTS) -> dict[str, Path]:
    """Every module under `roots` (the repository's packages) by its dotted name (a package by its
    own name)."""
    found: dict[str, Path] = {}
    for folder in roots.values():
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(folder.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of this repository it imports, by any import statement: top-level,
    under `if TYPE_CHECKING:` or inside a function, absolute or relative. `from p import x` counts
    as importing `p.x` when that is a module, else `p`."""

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                targets.update(known(f"{base}.{alias.name}") for alias in node.names)
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative), each as a
    cycle through it: modules that import each other, however indirectly."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(cycle_through(graph, set(component)))
    return found


def cycle_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """One import cycle inside a strongly connected component, from its first module back to it."""
    first = min(component)
    paths = {first: [first]}
    queue = [first]
    while queue:  # breadth first: the shortest way back
        node = queue.pop(0)
        for nxt in sorted(graph[node] & component):
            if nxt == first:
                return paths[node] + [first]
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                queue.append(nxt)
    raise AssertionError(f"no cycle in {sorted(component)}")


def test_the_cycle_finder_names_a_cycle_and_passes_a_tree() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_the_graph_reads_type_only_function_level_and_relative_imports(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n"
    )
    (package / "b.py").write_text("def f():\n    from . import a\n    import pkg.c\n")
    (package / "c.py").write_text("import json\nfrom pkg import d\n")
    graph = import_graph(module_names({"pkg": package}))
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a", "pkg.c"}, "pkg.c": {"pkg"}}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert len(module_names()) > 250  # the whole repository is read


def test_no_module_imports_itself_back() -> None:
    """No import cycle at any level, type-only ones included: a cycle is two modules that cannot be
    read (or split, or moved) apart, whether Python would trip over it at import time or not."""
    found = cycles(import_graph(module_names()))
    assert found == [], "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)
