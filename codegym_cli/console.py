"""`codegym console`: the web console (services/console) in front of a runtime, local or remote.
Its parser is console_options.py's; this module, which loads the web stack, runs it."""

from __future__ import annotations

import argparse

from codegym.server.settings import from_args
from codegym_cli.serve_setup import run_server, start
from services.console.settings import ConsoleSettings


def cmd_console(args: argparse.Namespace) -> int:
    settings = from_args(ConsoleSettings, args)
    auth = start(
        settings.access, settings.host, settings.log_level, settings.output, settings.calls
    )  # refuses a bad bind
    from services.console.server import serve

    run_server(lambda: serve(settings, auth))
    return 0
