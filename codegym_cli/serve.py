"""`codegym serve ...`: run one server in the foreground.

Each server's command is in a module of its own (serve_sandbox.py, serve_runtime.py,
serve_synthesis.py, serve_verification.py, and serve_openenv.py for the OpenEnv gateway), its options
declared once on its settings object; what they share is in serve_setup.py.
"""

from __future__ import annotations

import argparse

from codegym_cli import serve_openenv, serve_runtime, serve_sandbox, serve_synthesis, serve_verification


def register(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run a server in the foreground")
    servers = serve.add_subparsers(dest="serve_command", required=True, metavar="SERVER")
    for server in (serve_sandbox, serve_runtime, serve_synthesis, serve_verification, serve_openenv):
        server.add_parser(servers)
