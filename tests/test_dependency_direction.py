"""Dependencies point one way (README, "Where things are"): the client (`codegym_client`) at the
bottom, then the shared core (`codegym`), then the sandbox worker, the services and the command
line; above them what the tests and the benchmarks share (`codegym_testkit`), then the benchmarks,
which import no `tests` module. Every import statement of every module (function-level ones included) is read from its AST,
so a module that imports upwards fails here even when nothing runs that import."""

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
SHARED_SERVICE_MODULES = {"services", "services.dispatcher"}


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
