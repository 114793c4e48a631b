"""Finding the callable part of a problem's original solution, statically.

The original solution is a second opinion on every reference answer: where it is a plain
function, verification calls it (inside a sandbox, with `call_function`) on the same config and
compares. Which function and which config keys become its arguments is decided here with `ast`,
never by importing the solution.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SolutionCall:
    """`function(*[config[k] for k in arg_names])`."""

    function: str
    arg_names: tuple[str, ...]

    def args_for(self, config: dict[str, object]) -> list[object] | None:
        """Positional arguments for one config; None when the config lacks one of the keys."""
        if any(k not in config for k in self.arg_names):
            return None
        return [config[k] for k in self.arg_names]


def _functions(source: str) -> dict[str, ast.FunctionDef]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return {}
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def _params(fn: ast.FunctionDef) -> tuple[list[str], list[str]]:
    """(all positional parameter names, those without a default)."""
    names = [a.arg for a in [*fn.args.posonlyargs, *fn.args.args]]
    required = names[: len(names) - len(fn.args.defaults)]
    return names, required


def find_solution_call(
    source: str, config_keys: Sequence[str], entry_point: str = "", arg_names: Sequence[str] = ()
) -> SolutionCall | None:
    """The call to cross-check with, or None when the solution is not a callable function.

    With `entry_point`, that function (when the source defines it), its arguments taken from
    `arg_names` or, failing that, from its own parameter names. Without, the one top-level
    function whose parameters are exactly the config keys (required ones all present).
    """
    functions = _functions(source)
    if entry_point:
        fn = functions.get(entry_point)
        if fn is None:
            return None
        names, required = _params(fn)
        chosen = tuple(arg_names) if arg_names else tuple(names)
        if len(chosen) < len(required) or len(chosen) > len(names):
            return None
        return SolutionCall(entry_point, chosen)
    keys = set(config_keys)
    matches = []
    for name, fn in functions.items():
        if name.startswith("_") or fn.args.vararg or fn.args.kwarg:
            continue
        names, required = _params(fn)
        if names and set(required) <= keys <= set(names):
            matches.append(SolutionCall(name, tuple(n for n in names if n in keys)))
    return matches[0] if len(matches) == 1 else None
