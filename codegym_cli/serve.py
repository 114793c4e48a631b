"""`codegym serve ...`: run one server in the foreground.

Each server's command is in a module of its own (serve_sandbox.py, serve_runtime.py,
serve_synthesis.py, serve_verification.py, and serve_openenv.py for the OpenEnv gateway); what they
share is in serve_setup.py. This module puts them under `serve` and adds the options all of them
take, in one place.
"""

from __future__ import annotations

import argparse

from codegym_cli import serve_openenv, serve_runtime, serve_sandbox, serve_synthesis, serve_verification
from codegym_cli.serve_setup import add_access_arguments, add_output_arguments


def register(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run a server in the foreground")
    serve_sub = serve.add_subparsers(dest="serve_command", required=True, metavar="SERVER")
    sandbox = serve_sandbox.add_parser(serve_sub)
    runtime = serve_runtime.add_parser(serve_sub)
    synthesis = serve_synthesis.add_parser(serve_sub)
    verification = serve_verification.add_parser(serve_sub)
    openenv = serve_openenv.add_parser(serve_sub)
    # The gRPC servers' access options; the gateway, which speaks HTTP, has its own.
    for server in (sandbox, runtime, synthesis, verification):
        add_access_arguments(server)
    for server in (sandbox, runtime, synthesis, verification, openenv):
        add_output_arguments(server)
