"""The product functions of 80 lines or more, longest first, read from the AST: the ones to look
at for a function doing more than one thing (a count to watch, not a budget to meet).

    .venv/bin/python -m tests.helpers.long_functions [min_lines]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from tests.conftest import ROOT

PRODUCT = ("codegym", "codegym_jobs", "codegym_cli", "sandbox_worker", "services", "clients/codegym_client")


def long_functions(min_lines: int = 80, root: Path = ROOT) -> list[tuple[int, str]]:
    """(lines, "path:line name") of every function or method of the product code (generated
    protobuf modules aside) spanning at least `min_lines` lines, longest first."""
    found = []
    for folder in PRODUCT:
        for path in sorted((root / folder).rglob("*.py")):
            if "_pb2" in path.name or "__pycache__" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                    lines = node.end_lineno - node.lineno + 1
                    if lines >= min_lines:
                        found.append((lines, f"{path.relative_to(root)}:{node.lineno} {node.name}"))
    return sorted(found, key=lambda row: (-row[0], row[1]))


def main() -> None:
    rows = long_functions(int(sys.argv[1]) if len(sys.argv) > 1 else 80)
    for lines, where in rows:
        print(f"{lines:4d}  {where}")
    print(f"{len(rows)} functions")


if __name__ == "__main__":
    main()
