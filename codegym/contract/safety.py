"""Static scan for risky constructs in untrusted environment code.

The sandbox contains whatever the code does; this scan is a cheap earlier signal that
verification uses to flag or reject sources that reach for the interpreter or the system.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

RISKY_CALLS = frozenset({"eval", "exec", "compile", "__import__", "open", "breakpoint", "globals", "vars"})
RISKY_MODULES = frozenset(
    {"os", "sys", "subprocess", "socket", "ctypes", "importlib", "shutil", "multiprocessing", "signal", "pty"}
)
SAFE_DUNDERS = frozenset({"__init__", "__name__", "__doc__"})


@dataclass(frozen=True)
class Finding:
    kind: str
    detail: str
    line: int

    def __str__(self) -> str:
        return f"line {self.line}: {self.kind}: {self.detail}"


def scan_source(source: str) -> list[Finding]:
    """Findings in source order; a source that does not parse yields none (the contract check reports it)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    findings: list[Finding] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in RISKY_CALLS:
            findings.append(Finding("call", f"{node.func.id}()", node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in RISKY_MODULES:
                    findings.append(Finding("import", alias.name, node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in RISKY_MODULES:
            findings.append(Finding("import", node.module, node.lineno))
        elif (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("__")
            and node.attr.endswith("__")
            and node.attr not in SAFE_DUNDERS
        ):
            findings.append(Finding("dunder_attribute", f".{node.attr}", node.lineno))
        elif isinstance(node, ast.Name) and node.id == "__builtins__":
            findings.append(Finding("dunder_name", "__builtins__", node.lineno))
    findings.sort(key=lambda f: f.line)
    return findings
