"""A command's function, imported when the command runs: `codegym --help` and every command's
parser are built without loading what the commands use (gRPC, rich, the LLM client, the library)."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable


def later(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """`module.name(args)`, `module` imported on the call."""

    def run(args: argparse.Namespace) -> int:
        command: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(module), name)
        return command(args)

    run.__qualname__ = run.__name__ = f"{module}.{name}"
    return run
