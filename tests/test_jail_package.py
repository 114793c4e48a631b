"""The fence around the code that runs inside jails: `codegym/inside/` imports the standard
library only (and itself), so what is mounted into a jail is all a jail needs, and nothing of the
trusted side (grpc, the project's other packages) can leak in. And the messages it declares for
the worker <-> jail pipe name what the RPC names."""

from __future__ import annotations

import ast
import subprocess
import sys
from typing import get_args

from tests.conftest import ROOT

INSIDE = ROOT / "codegym" / "inside"


# What environments themselves import: the jail's code may touch them only inside a function (when
# an environment is being served), never at import time.
ENVIRONMENT_LIBRARIES = {"gymnasium", "numpy"}


def imports(path: str) -> list[tuple[str, int, bool]]:
    """(module, relative level, inside a function) for every import statement of a file."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((alias.name, 0, in_function) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module or "", node.level, in_function))
        inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return found


def test_every_module_inside_imports_the_standard_library_only() -> None:
    modules = sorted(INSIDE.glob("*.py"))
    assert {m.name for m in modules} >= {"zygote.py", "frames.py", "operations.py", "hygiene.py"}
    outside = {
        f"{path.name}: {name}"
        for path in modules
        for name, level, in_function in imports(str(path))
        if level == 0
        and name.split(".")[0] not in sys.stdlib_module_names
        and name.split(".")[0] != "inside"  # the package itself, as the jail names it
        and not (in_function and name.split(".")[0] in ENVIRONMENT_LIBRARIES)
    }
    assert outside == set()


def test_the_package_imports_with_no_site_packages_at_all() -> None:
    """As the jail sees it: the folder on the path as `inside`, no site-packages (-S), no user site."""
    names = sorted(f"inside.{p.stem}" for p in INSIDE.glob("*.py") if p.stem != "__init__")
    code = f"import sys; sys.path.insert(0, {str(INSIDE.parent)!r}); import " + ", ".join(names)
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def test_the_pipes_operations_and_statuses_are_the_rpcs() -> None:
    """Every operation the RPC has is one the jail's messages declare, and every status a jail may
    answer has its RPC status (the worker maps an unknown one to CRASHED)."""
    from codegym.inside.messages import Op, Status
    from codegym.sandbox.v1 import sandbox_service_pb2 as pb
    from sandbox_worker.service import STATUS

    kinds = {field.name for field in pb.Operation.DESCRIPTOR.oneofs_by_name["kind"].fields}
    assert set(get_args(Op)) == kinds
    assert set(get_args(Status)) == set(STATUS)
