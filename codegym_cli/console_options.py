"""`codegym console`'s parser: its options are `ConsoleSettings`' (services/console/settings.py);
the command itself (codegym_cli/console.py, which imports the web stack) loads when it runs."""

from __future__ import annotations

import argparse

from codegym.server.settings import add_arguments
from codegym_cli.later import later
from services.console.settings import ConsoleSettings


def register(sub: argparse._SubParsersAction) -> None:
    console = sub.add_parser(
        "console",
        help="web console: browse the library, play a task by hand, read captured episodes, watch a "
        "run's curriculum and the library's health",
        description="Server-rendered pages in front of a runtime's API (it never reads a library file, "
        "so the runtime may be remote). With access tokens (--tokens), people sign in with a trainer's "
        "token (its own tenant's data, play) or an operator's (every tenant, lifting quarantines, "
        "environment code); the console calls the runtime with --token (the service token), naming "
        "each trainer's tenant. Without tokens it binds loopback only unless --insecure. See "
        "docs/console.md.",
    )
    add_arguments(ConsoleSettings, console)
    console.set_defaults(func=later("codegym_cli.console", "cmd_console"))
